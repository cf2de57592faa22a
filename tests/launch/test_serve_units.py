"""``kvtier serve`` for one instance, without vLLM: slots sized from the model's config, and
the vLLM command line it builds (unknown options passed through)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.launch.sizing import estimate_payload_len, flag_value


def test_payload_estimate_from_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 256, "dtype": "bfloat16"}))
    assert estimate_payload_len(str(tmp_path), [], 256) == 4 * 2 * 2 * 64 * 256 * 2
    assert estimate_payload_len(str(tmp_path), ["--dtype=float32"], 256) == 4 * 2 * 2 * 64 * 256 * 4
    assert estimate_payload_len(str(tmp_path), ["-tp", "4", "--kv-cache-dtype", "fp8"], 256) == (
        4 * 2 * 4 * 64 * 256 * 1)
    assert estimate_payload_len(str(tmp_path / "missing"), [], 256) is None


@pytest.mark.parametrize("named", [{"torch_dtype": "float32"}, {"dtype": "float32"}, {}])
def test_auto_dtype_downcasts_float32_as_vllm_does(tmp_path: Path, named: dict[str, str]
                                                   ) -> None:
    """vLLM's ``--dtype auto`` runs a float32 (or dtype-less) model in 16 bits: slots too."""
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 256, **named}))
    sixteen = 4 * 2 * 2 * 64 * 256 * 2
    assert estimate_payload_len(str(tmp_path), [], 256) == sixteen
    assert estimate_payload_len(str(tmp_path), ["--dtype", "auto"], 256) == sixteen
    assert estimate_payload_len(str(tmp_path), ["--dtype", "float32"], 256) == 2 * sixteen
    assert flag_value(["--port", "1", "--port=2"], "--port") == "2"


def test_serve_passes_unknown_options_to_vllm(tmp_path: Path) -> None:
    from kvtier.launch.serve import build_plan, register

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64}))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", str(model), "--port", "8123",
                              "--arena-size", "64MiB", "--disk-path", str(tmp_path / "d"),
                              "--max-model-len=4096", "--", "--dtype", "float32"])
    plan = build_plan(args)
    assert plan.cmd[-5:] == ["--port", "8123", "--max-model-len=4096", "--dtype", "float32"]
    transfer = json.loads(plan.cmd[plan.cmd.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_module_path"] == "kvtier.vllm"
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert plan.server is not None
    assert transfer["kv_connector_extra_config"]["server_socket"] == plan.server.socket_path
    assert plan.server.arena.slot_bytes == 4096 + 2 * 2 * 2 * 32 * 256 * 4
    assert plan.server.tiers[0].options["path"] == str(tmp_path / "d")
    assert "--enable-prompt-tokens-details" in plan.cmd  # cached_tokens for OpenAI clients
    assert plan.base_url == "http://127.0.0.1:8123"
    assert plan.log_file is not None and plan.log_file.name == "serve-8123.log"
    quiet = build_plan(parser.parse_args(["serve", "--model", str(model), "--log-file", "-",
                                          "--enable-prompt-tokens-details"]))
    assert quiet.log_file is None and quiet.cmd.count("--enable-prompt-tokens-details") == 1
    with pytest.raises(ConfigError, match="kv-transfer-config"):
        build_plan(parser.parse_args(["serve", "--model", str(model),
                                      "--kv-transfer-config", "{}"]))


def test_size_flags_replace_the_server_config_sizes(tmp_path: Path) -> None:
    """A Kubernetes pod shares one config file and sets its sizes on the command line:
    --arena-size and --disk-size win over the file; a file with no single disk tier is told."""
    from kvtier.launch.serve import build_plan, register

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64}))
    config = tmp_path / "server.yaml"
    config.write_text("arena: {size_bytes: 32MiB}\ntiers:\n  - type: disk\n"
                      f"    capacity_bytes: 1GiB\n    options: {{path: {tmp_path / 'd'}}}\n")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())

    def plan(*flags: str) -> object:
        return build_plan(parser.parse_args(["serve", "--model", str(model), "--server-config",
                                             str(config), *flags]))

    kept = plan()
    assert kept.server.arena.size_bytes == 32 << 20  # type: ignore[attr-defined]
    assert kept.server.tiers[0].capacity_bytes == 1 << 30  # type: ignore[attr-defined]
    sized = plan("--arena-size", "64MiB", "--disk-size", "2GiB")
    assert sized.server.arena.size_bytes == 64 << 20  # type: ignore[attr-defined]
    assert sized.server.tiers[0].capacity_bytes == 2 << 30  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="--arena-size"):
        plan("--arena-size", "lots")
    config.write_text("arena: {size_bytes: 32MiB}\n")
    with pytest.raises(ConfigError, match=r"--disk-size: .* has 0 disk tiers"):
        plan("--disk-size", "2GiB")


def test_a_port_taken_on_vllms_own_address_is_found_before_vllm_starts() -> None:
    """``kvtier serve --host ADDR``: the port is checked on ADDR, where vLLM will bind (a
    server listening on 127.0.0.2 leaves 127.0.0.1's port bindable)."""
    import socket

    from kvtier.launch.plan import ServePlan
    from kvtier.launch.serve_one import _wait_ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.2", 0))
        taken.listen()
        port = taken.getsockname()[1]
        plan = ServePlan(cmd=[], server=None, base_url=f"http://127.0.0.2:{port}")
        with pytest.raises(ConfigError, match=rf"port {port} \(vLLM's API server\) is in use "
                                              r"on 127\.0\.0\.2"):
            _wait_ports(plan)
        _wait_ports(ServePlan(cmd=[], server=None, base_url=f"http://127.0.0.1:{port}"))
