"""``apa attribute``'s configs: each variant's change is what runs, in our column and in the seed's.

The seed column is the variant on the seed's arithmetic: the seed's toggles, then the variant's change
on top of them, so a variant that changes a seed toggle ("all, exact MMA") is that change on the seed,
not the seed again (mutant S2: the toggles applied after the change undid it, and the column quietly
repeated the seed's default)."""

from __future__ import annotations

import pytest

from apa_emu.config import SEED_TOGGLES, Config
from apa_emu.study.commands.attribute import ATTRIBUTE_VARIANTS, _variant_configs

BASES = [Config(), Config(eps=0.01, hot_test="output")]


@pytest.mark.parametrize("base", BASES, ids=["default", "output-test"])
def test_each_variant_runs_its_change_in_both_columns(base):
    configs, on_sm90 = _variant_configs(base, ATTRIBUTE_VARIANTS, True)
    overridden = 0
    for name, change in ATTRIBUTE_VARIANTS.items():
        ours, seed = configs[name], configs["seed", name]
        for key, value in change.items():
            assert getattr(ours, key) == value, (name, key)
            if not (key == "mma" and name in on_sm90):
                assert getattr(seed, key) == value, f"seed column of {name!r}: {key} is not the variant's"
        for key, value in SEED_TOGGLES.items():
            if key not in change and not (key == "mma" and name in on_sm90):
                assert getattr(seed, key) == value, f"seed column of {name!r}: {key} is not the seed's"
        overridden += any(key in SEED_TOGGLES and change[key] != SEED_TOGGLES[key] for key in change)
        assert seed.eps == base.eps and seed.hot_test == base.hot_test  # the command's own config stays
    assert overridden >= 1  # some variant does change a seed toggle: the case that tells the orders apart
    assert configs["seed", "all, exact MMA"].mma == "exact"


def test_the_seed_twin_of_a_variant_without_fp4_operands_falls_back_to_sm90():
    configs, on_sm90 = _variant_configs(Config(), ATTRIBUTE_VARIANTS, True)
    assert "none" in on_sm90 and configs["seed", "none"].mma == "sm90"
    assert "all (default)" not in on_sm90 and configs["seed", "all (default)"] == Config.seed()
