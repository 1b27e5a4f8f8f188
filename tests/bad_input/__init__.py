"""Bad input, in one place and by entry point: every public entry point refuses a malformed call with an error
that names the argument and the value, changes nothing it was given, and accepts valid numpy and JAX scalars.

  test_each_entry_point   one malformed field per case, for every public entry point (a table of cases);
  test_attention          attention, the KV write, the layer parameters and the metadata, ``checked=True``;
  test_metadata_helpers   the host-side metadata helpers and `AllocatorConfig`;
  test_allocator          the allocator's calls, whose refusals leave its whole state as it was;
  test_engine_arguments   the engine's options and `Engine.add_request`;
  test_jax_properties     mutated calls of the JAX entry points, drawn by hypothesis;
  test_torch_properties   every one of over a thousand mutated calls of the PyTorch backend and `to_jax`.
"""
