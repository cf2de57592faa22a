"""Admission rules: which chunks may be written to a lower tier at all."""

from __future__ import annotations

import hashlib

import pytest

from kvtier.config import ServerConfig
from kvtier.errors import ConfigError, UnknownBackendError
from kvtier.policies import ADMISSION, AdmissionContext, admits, make_admission
from kvtier.policies.admission import AfterUses, Always, MinPrefixTokens, MinPriority


def key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def ctx(name: str = "a", priority: int = 35, prefix_tokens: int = 256) -> AdmissionContext:
    return AdmissionContext(key(name), priority, prefix_tokens)


def test_registered_rules() -> None:
    assert list(ADMISSION) == ["after_uses", "always", "min_prefix_tokens", "min_priority"]
    assert ADMISSION["after_uses"] is AfterUses


def test_always_admits_everything() -> None:
    rule = Always(0)
    assert rule.admit(ctx(priority=0, prefix_tokens=0))
    assert rule.admit(ctx(priority=100, prefix_tokens=10**6))


def test_after_uses_admits_only_after_n_uses_of_that_key() -> None:
    rule = AfterUses(2)
    assert not rule.admit(ctx("a"))
    rule.record(key("a"))
    assert not rule.admit(ctx("a"))
    rule.record(key("a"))
    assert rule.admit(ctx("a"))
    assert not rule.admit(ctx("b"))
    assert (rule.uses(key("a")), rule.uses(key("b"))) == (2, 0)


def test_after_uses_forgets_the_least_recently_used_keys_past_max_tracked() -> None:
    rule = AfterUses(1, max_tracked=3)
    for name in ("a", "b", "c"):
        rule.record(key(name))
    rule.record(key("a"))  # a is now the most recent; b is the oldest
    rule.record(key("d"))
    assert [rule.uses(key(n)) for n in "abcd"] == [2, 0, 1, 1]
    assert not rule.admit(ctx("b"))
    rule.record(key("e"))
    assert [rule.uses(key(n)) for n in "acde"] == [2, 0, 1, 1]


def test_after_uses_zero_admits_unseen_keys() -> None:
    assert AfterUses(0).admit(ctx("never-seen"))


def test_min_priority_admits_at_or_above_its_threshold() -> None:
    rule = MinPriority(50)
    assert [rule.admit(ctx(priority=p)) for p in (0, 49, 50, 100)] == [False, False, True, True]


def test_min_prefix_tokens_admits_long_enough_prefixes() -> None:
    rule = MinPrefixTokens(1024)
    verdicts = [rule.admit(ctx(prefix_tokens=t)) for t in (256, 1023, 1024, 4096)]
    assert verdicts == [False, False, True, True]


def test_make_admission_builds_each_rule_with_its_parameter() -> None:
    rules = make_admission([("after_uses", 2), ("min_priority", 50)])
    assert [type(rule) for rule in rules] == [AfterUses, MinPriority]
    assert [rule.param for rule in rules] == [2, 50]


def test_admits_requires_every_rule_to_pass() -> None:
    rules = make_admission([("after_uses", 1), ("min_priority", 50)])
    assert not admits(rules, ctx("a", priority=80))  # never used
    for rule in rules:
        rule.record(key("a"))
    assert admits(rules, ctx("a", priority=80))
    assert not admits(rules, ctx("a", priority=35))  # used, but priority too low


def test_no_rules_admit_everything() -> None:
    assert admits(make_admission([]), ctx(priority=0, prefix_tokens=0))


def test_unknown_rule_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownBackendError, match="known: after_uses, always"):
        make_admission([("sometimes", 1)])


# --- the config parser ----------------------------------------------------------------------


def tier_admission(value: object) -> tuple[tuple[str, int], ...]:
    tier = {"type": "disk", "capacity_bytes": "1GiB", "admission": value}
    return ServerConfig.from_dict({"tiers": [tier]}).tiers[0].admission


def test_config_parses_rules_in_order_and_drops_always() -> None:
    parsed = tier_admission({"always": 0, "after_uses": 2, "min_priority": 50})
    assert parsed == (("after_uses", 2), ("min_priority", 50))
    assert make_admission(parsed)[0].param == 2


@pytest.mark.parametrize("value", ["always", None, {}])
def test_config_always_means_no_rules(value: object) -> None:
    assert tier_admission(value) == ()


def test_config_rejects_unknown_rule_names_naming_the_key() -> None:
    message = r"^tiers\[0\]\.admission\.bogus: unknown admission rule; allowed: .*after_uses"
    with pytest.raises(ConfigError, match=message):
        tier_admission({"after_uses": 2, "bogus": 1})


@pytest.mark.parametrize("param", [-1, "two", 1.5, True, None])
def test_config_rejects_bad_rule_values_naming_the_key(param: object) -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.admission\.after_uses: .*non-negative"):
        tier_admission({"after_uses": param})


@pytest.mark.parametrize("value", [["after_uses"], "after_uses", 3])
def test_config_rejects_admission_that_is_not_a_mapping(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.admission: expected a mapping"):
        tier_admission(value)
