"""Configuration is parsed once into frozen structs; errors name the dotted key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvtier.config import ArenaConfig, ServerConfig, TierConfig, parse_size
from kvtier.errors import ConfigError

GiB = 2**30


def disk(**fields: Any) -> dict[str, Any]:
    return {"type": "disk", "capacity_bytes": "10GiB", **fields}


def config(**data: Any) -> ServerConfig:
    return ServerConfig.from_dict(data)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * GiB),
        ("1.5GB", 1_500_000_000),
        (123, 123),
        (0, 0),
        ("512MiB", 512 * 2**20),
        (" 2 gb ", 2_000_000_000),
        ("64k", 64_000),
        ("1TiB", 2**40),
        ("4096", 4096),
        ("7B", 7),
    ],
)
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["four", "4XB", "4 GiB!", "1.2.3GB", "", "-5MiB", -1, True, None])
def test_bad_sizes_name_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^arena\.size_bytes: "):
        parse_size(bad, "arena.size_bytes")


def test_sizes_inside_the_config() -> None:
    cfg = config(arena={"size_bytes": "2GiB", "slot_bytes": "1MiB"}, tiers=[disk()])
    assert cfg.arena.size_bytes == 2 * GiB
    assert cfg.arena.num_slots == 2048
    assert cfg.tiers[0].capacity_bytes == 10 * GiB
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.capacity_bytes: expected a size"):
        config(tiers=[disk(capacity_bytes="lots")])


@pytest.mark.parametrize(
    ("data", "where", "listed"),
    [
        ({"bogus": 1}, "bogus", ["arena", "log_level", "tiers"]),
        ({"arena": {"bogus": 1}}, "arena.bogus", ["eviction", "size_bytes", "slot_bytes"]),
        ({"tiers": [disk(), disk(bogus=1)]}, r"tiers\[1\].bogus", ["admission", "write_policy"]),
    ],
)
def test_unknown_keys_are_rejected_at_every_level(
    data: dict[str, Any], where: str, listed: list[str]
) -> None:
    with pytest.raises(ConfigError, match=rf"^{where}: unknown key; allowed: ") as info:
        ServerConfig.from_dict(data)
    allowed = str(info.value).split("allowed: ")[1].split(", ")
    assert set(listed) <= set(allowed)
    assert allowed == sorted(allowed)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"lease_ttl_s": "fast"}, "lease_ttl_s: expected a number"),
        ({"lease_ttl_s": True}, "lease_ttl_s: expected a number"),
        ({"metrics_port": "9100"}, "metrics_port: expected an integer"),
        ({"socket_path": 5}, "socket_path: expected a string"),
        ({"arena": {"prefault": "yes"}}, "arena.prefault: expected true or false"),
        ({"arena": 5}, "arena: expected a mapping"),
        ({"tiers": {"type": "disk"}}, "tiers: expected a list"),
        ({"tiers": [disk(options=[1])]}, r"tiers\[0\].options: expected a mapping"),
        ({"tiers": [{"type": "disk"}]}, r"tiers\[0\]: .*capacity_bytes"),
        ({"arena": {"eviction": "mru"}}, "arena.eviction: unknown eviction policy 'mru'"),
        ({"arena": {"eviction": ["lru"]}}, "arena.eviction: expected a string"),
        ({"arena": {"slot_bytes": 1000}}, "arena.slot_bytes must be a multiple of 4096"),
        ({"tiers": [disk(breaker={"errors": 0})]}, r"tiers\[0\]\.breaker\.errors must be"),
        ({"arena": {1: 2}}, "arena: keys must be strings"),
        ({"lease_ttl_s": 0}, "lease_ttl_s must be positive"),
        ({"metrics_port": 70000}, "metrics_port must be in"),
    ],
)
def test_wrong_types_and_values_name_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        ServerConfig.from_dict(data)


@pytest.mark.parametrize("policy", ["through", "back"])
def test_write_policy_accepts_through_and_back(policy: str) -> None:
    assert config(tiers=[disk(write_policy=policy)]).tiers[0].write_policy == policy


def test_write_policy_rejects_anything_else_listing_the_allowed_values() -> None:
    message = r"^tiers\[0\]\.write_policy: got 'around'; allowed: through, back$"
    with pytest.raises(ConfigError, match=message):
        config(tiers=[disk(write_policy="around")])


def test_log_level_is_one_of_four_names() -> None:
    assert config(log_level="debug").log_level == "debug"
    message = "^log_level: got 'verbose'; allowed: debug, info, warning, error$"
    with pytest.raises(ConfigError, match=message):
        config(log_level="verbose")


def test_defaults_and_nested_structs() -> None:
    cfg = config(tiers=[disk(eviction="s3fifo", options={"path": "/tmp/x"})])
    assert isinstance(cfg.arena, ArenaConfig) and cfg.arena.eviction == "lru"
    assert isinstance(cfg.tiers, tuple) and isinstance(cfg.tiers[0], TierConfig)
    assert cfg.tiers[0].eviction == "s3fifo"
    assert cfg.tiers[0].options == {"path": "/tmp/x"}
    assert (cfg.log_level, cfg.lease_ttl_s, cfg.metrics_port) == ("info", 30.0, None)


def test_default_socket_path_follows_xdg_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert ServerConfig().socket_path == "/run/user/1234/kvtier.sock"
    assert config(socket_path="/tmp/k.sock").socket_path == "/tmp/k.sock"


YAML = """\
socket_path: /tmp/kvtier-test.sock
log_level: warning
arena:
  size_bytes: 64MiB
  eviction: arc
tiers:
  - type: disk
    capacity_bytes: 1.5GB
    admission: {after_uses: 2}
    write_policy: back
"""


def test_from_yaml_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(YAML)
    cfg = ServerConfig.from_yaml(path)
    assert cfg.socket_path == "/tmp/kvtier-test.sock"
    assert cfg.log_level == "warning"
    assert (cfg.arena.size_bytes, cfg.arena.eviction) == (64 * 2**20, "arc")
    tier = cfg.tiers[0]
    assert (tier.type, tier.capacity_bytes, tier.write_policy) == ("disk", 1_500_000_000, "back")
    assert tier.admission == (("after_uses", 2),)


def test_an_empty_yaml_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert ServerConfig.from_yaml(path).tiers == ()


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing.yaml", None, "cannot read config file"),
        ("a_directory", "dir", "cannot read config file"),
        ("broken.yaml", "arena: [1, 2", "cannot read config file"),
        ("list.yaml", "- 1\n- 2\n", "the top level must be a mapping"),
        ("bad.yaml", "arena: {bogus: 1}\n", r"^arena\.bogus: unknown key"),
    ],
)
def test_unreadable_or_bad_files_raise_config_error(
    tmp_path: Path, name: str, text: str | None, message: str
) -> None:
    path = tmp_path / name
    if text == "dir":
        path.mkdir()
    elif text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        ServerConfig.from_yaml(path)


def test_config_is_frozen() -> None:
    cfg = config(tiers=[disk()])
    with pytest.raises(AttributeError):
        cfg.lease_ttl_s = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.arena.size_bytes = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.tiers[0].write_policy = "back"  # type: ignore[misc]


def test_parsed_values_are_plain_ints_and_tuples_msgspec_can_encode() -> None:
    cfg = config(max_message_bytes="1MiB",
                 tiers=[disk(keep_free_bytes="1MiB", admission={"after_uses": 2})])
    tier = cfg.tiers[0]
    assert type(tier.capacity_bytes) is int and type(tier.keep_free_bytes) is int
    assert type(cfg.max_message_bytes) is int and type(tier.admission) is tuple
    assert msgspec.json.decode(msgspec.json.encode(cfg))["tiers"][0]["capacity_bytes"] == 10 * GiB


def test_direct_construction_and_replace_run_the_same_checks() -> None:
    tier = TierConfig(type="disk", capacity_bytes="2GiB", admission=(("after_uses", 2),))
    assert (tier.capacity_bytes, tier.admission) == (2 * GiB, (("after_uses", 2),))
    cfg = config(tiers=[disk()])
    assert msgspec.structs.replace(cfg, lease_ttl_s=5).lease_ttl_s == 5
    with pytest.raises(ConfigError, match=r"^tiers: names must be unique"):
        msgspec.structs.replace(cfg, tiers=cfg.tiers * 2)
