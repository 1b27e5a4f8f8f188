"""A sampled product of test axes in which every value of every axis appears."""

import numpy as np


def covering_sample(axes: dict[str, list], num_cases: int, *, seed: int) -> list[dict]:
    """`num_cases` combinations; each axis cycles through a shuffled order of its values, so every value
    appears at least ``num_cases // len(values)`` times, each time in different company."""
    rng = np.random.default_rng(seed)
    orders = {name: rng.permutation(len(values) * -(-num_cases // len(values))) % len(values) for name, values in axes.items()}
    return [{name: axes[name][orders[name][i]] for name in axes} for i in range(num_cases)]
