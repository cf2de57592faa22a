"""``kvtier plan``: budgets against hand-computed figures, the weight-offload refusal, and a
server config that ``kvtier server`` accepts."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import yaml

from kvtier.cli import main
from kvtier.config import ServerConfig
from kvtier.errors import ConfigError
from kvtier.launch.sizing import estimate_payload_len
from kvtier.plan import CPU_OFFLOAD_NOTE, DeviceInputs, DiskInputs, HostInputs, make_plan
from kvtier.plan.budget import device_budget, host_budget, payload_bytes
from kvtier.plan.model import read_model
from kvtier.trace.formats import Trace
from kvtier.trace.generate import GenConfig, generate

GiB = 1 << 30
LLAMA3_8B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
             "vocab_size": 128256, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    return folder


def test_parameters_estimated_from_the_config(llama: Path) -> None:
    m = read_model(llama)
    # embeddings 2 * 128256 * 4096; per layer: q,o 2*4096*4096 + k,v 2*4096*1024 + MLP
    # 3*4096*14336 + norms 2*4096; 32 layers; final norm 4096
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert m.params == 2 * 128256 * 4096 + 32 * per_layer + 4096 == 8_030_261_248
    assert not m.params_exact and m.dtype == "bfloat16"
    assert m.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131_072


def test_parameters_counted_from_safetensors_headers(llama: Path) -> None:
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "a": {"dtype": "BF16", "shape": [10, 20], "data_offsets": [0, 400]},
                         "b": {"dtype": "BF16", "shape": [5], "data_offsets": [400, 410]}})
    data = header.encode()
    (llama / "model.safetensors").write_bytes(struct.pack("<Q", len(data)) + data + b"\0" * 410)
    m = read_model(llama)
    assert m.params == 205 and m.params_exact


def test_device_budget_by_hand(llama: Path) -> None:
    m = read_model(llama)
    b = device_budget(m, DeviceInputs(device_bytes=80 * GiB, gpu_memory_utilization=0.9))
    assert b.usable_bytes == 77_309_411_328                      # 80 GiB * 0.9
    assert b.weights_bytes == 16_060_522_496                     # 8.03B params * 2 bytes
    activations = 8192 * (4 * 4096 + 2 * 14336) * 2              # 738,197,504
    logits = 256 * 128256 * 4                                    # 131,334,144
    assert b.workspace_bytes == activations + logits + GiB // 2 + GiB == 2_480_144_384
    assert b.kv_bytes == 77_309_411_328 - 16_060_522_496 - 2_480_144_384 == 58_768_744_448
    assert b.kv_bytes_per_token == 131_072
    assert b.kv_tokens == 448_368             # 58,768,744,448 / 131,072 = 448,369.7 -> blocks
    assert b.full_sequences == pytest.approx(448_368 / 8192)


def test_device_budget_with_tensor_parallelism(llama: Path) -> None:
    m = read_model(llama)
    b = device_budget(m, DeviceInputs(device_bytes=80 * GiB, tp=2))
    assert b.weights_bytes == 8_030_261_248                       # half the weights per GPU
    assert b.workspace_bytes == 8192 * (16384 + 14336) * 2 + 131_334_144 + GiB // 2 + GiB
    assert b.kv_bytes_per_token == 2 * 32 * 4 * 128 * 2           # 4 of 8 KV heads per rank
    assert b.kv_tokens == 1_022_848


def test_host_headroom_by_hand(llama: Path) -> None:
    m = read_model(llama)
    ram = 512 * GiB
    payload = payload_bytes(m, 1, 256)
    assert payload == 32 * 2 * 8 * 128 * 256 * 2 == 32 << 20
    h = host_budget(HostInputs(ram_bytes=ram, colocated_bytes=16 * GiB), 1, 0.0, payload, 256)
    assert h.os_bytes == ram // 20 and h.page_cache_bytes == ram // 10
    assert h.engines_bytes == 6 * GiB                             # 2 GiB + 4 GiB per GPU
    left = ram - ram // 20 - ram // 10 - 16 * GiB - 6 * GiB       # 443,670,121,678
    assert h.margin_bytes == int(left * 0.1) and h.headroom_bytes == left - int(left * 0.1)
    assert h.slot_bytes == 4096 + (32 << 20)                       # header + payload
    assert h.arena_slots == 11_898 and h.arena_tokens == 11_898 * 256


def test_weight_offload_is_not_kv_capacity(llama: Path) -> None:
    m = read_model(llama)
    plain = DeviceInputs(device_bytes=80 * GiB)
    offload = DeviceInputs(device_bytes=80 * GiB, cpu_offload_gb=10)
    # the device KV budget does not grow by the offloaded weights ...
    assert device_budget(m, offload).kv_tokens == device_budget(m, plain).kv_tokens
    host = HostInputs(ram_bytes=512 * GiB)
    payload = payload_bytes(m, 1, 256)
    a = host_budget(host, 1, 0.0, payload, 256)
    b = host_budget(host, 1, 10.0, payload, 256)
    # ... and the host gives 10 GiB less to the arena (less 10% margin on it), never more
    assert b.weight_offload_bytes == 10 * GiB
    assert abs(a.headroom_bytes - b.headroom_bytes - 9 * GiB) <= 1
    # a model that only fits with offloading gets no KV budget from it
    with pytest.raises(ConfigError, match="weight offloading is not KV capacity"):
        device_budget(m, DeviceInputs(device_bytes=16 * GiB, cpu_offload_gb=8))


def test_the_cli_says_why_weight_offload_is_refused(llama: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", str(llama), "--device-memory", "80GiB", "--host-ram",
               "256GiB", "--cpu-offload-gb", "8", "--disk-path", str(tmp_path / "d")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "note: " + CPU_OFFLOAD_NOTE in out
    assert re.search(r"- weight offload +8.00GiB", out)


def test_no_room_is_an_error_that_says_what_took_it(llama: Path) -> None:
    with pytest.raises(ConfigError, match="no room for a KV cache"):
        device_budget(read_model(llama), DeviceInputs(device_bytes=16 * GiB))
    disk = DiskInputs("/tmp/x", 0)
    with pytest.raises(ConfigError, match="no host headroom"):
        make_plan(read_model(llama), DeviceInputs(device_bytes=80 * GiB),
                  HostInputs(ram_bytes=8 * GiB), disk)


def test_payload_matches_the_connectors_slot_sizing(llama: Path) -> None:
    m = read_model(llama)
    for tp in (1, 2, 16):
        assert payload_bytes(m, tp, 256) == estimate_payload_len(
            str(llama), ["--tensor-parallel-size", str(tp)], 256)


def test_pilot_without_a_trace_is_bounded_and_has_no_disk_tier(llama: Path) -> None:
    m = read_model(llama)
    plan = make_plan(m, DeviceInputs(device_bytes=80 * GiB), HostInputs(ram_bytes=2048 * GiB),
                     DiskInputs("/var/tmp/kvtier", 10 << 40))
    device_bytes = plan.device.kv_tokens * 131_072
    assert plan.arena_bytes <= 2 * device_bytes + plan.host.slot_bytes
    assert plan.arena_bytes < plan.host.arena_bytes  # less than all that fits
    assert "tiers" not in plan.config and plan.disk_bytes == 0
    ServerConfig.from_dict(plan.config)


def _trace(sessions: int) -> Trace:
    requests = generate(GenConfig(sessions=sessions, seed=4, session_rate=5.0,
                                  think_time_s=5.0))
    return Trace(source="gen", format="mooncake", block_tokens=512, requests=requests)


def test_with_a_trace_the_four_questions_size_the_tiers(llama: Path) -> None:
    m = read_model(llama)
    trace = _trace(60)
    plan = make_plan(m, DeviceInputs(device_bytes=80 * GiB), HostInputs(ram_bytes=512 * GiB),
                     DiskInputs("/var/tmp/kvtier", 1 << 40), trace=trace)
    a = plan.advice
    assert a is not None and a.reach is not None
    assert 0 < a.analysis.reuse.never_reused_share < 1
    assert a.recommendation.host is not None  # the arena that fits reaches the target
    assert plan.arena_bytes <= plan.host.arena_bytes and plan.disk_bytes == 0
    assert plan.arena_bytes // plan.host.slot_bytes * 256 >= a.arena_tokens


def test_a_disk_tier_when_the_arena_that_fits_is_too_small(llama: Path) -> None:
    m = read_model(llama)
    trace = _trace(60)
    # room for 20 slots (5120 tokens) only: far from the ~90k tokens the target needs
    host = HostInputs(ram_bytes=20 * (4096 + (32 << 20)), os_bytes=0, page_cache_bytes=0,
                      engine_bytes=0, margin=0.0)
    plan = make_plan(m, DeviceInputs(device_bytes=80 * GiB), host,
                     DiskInputs("/var/tmp/kvtier", 1 << 40), trace=trace)
    assert plan.host.arena_slots == 20
    assert plan.arena_bytes == plan.host.arena_bytes
    assert plan.disk_bytes > 0
    tiers = ServerConfig.from_dict(plan.config).tiers
    assert tiers[0].type == "disk" and tiers[0].capacity_bytes == plan.disk_bytes


def test_the_cli_writes_a_config_the_server_accepts(llama: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    assert main(["trace", "generate", "--sessions", "40", "-o", str(trace)]) == 0
    out, doc = tmp_path / "server.yaml", tmp_path / "plan.json"
    rc = main(["plan", "--model", str(llama), "--device-memory", "80GiB", "--host-ram",
               "96GiB", "--trace", str(trace), "--disk-path", str(tmp_path / "disk"),
               "--disk-size", "200GiB", "-o", str(out), "--json", str(doc)])
    assert rc == 0
    config = ServerConfig.from_yaml(out)
    assert config.arena.slot_bytes == 4096 + (32 << 20)
    assert yaml.safe_load(out.read_text()) == json.loads(doc.read_text())["config"]


def test_host_ram_comes_from_meminfo_total(tmp_path: Path) -> None:
    from kvtier.plan.cli import meminfo

    (tmp_path / "meminfo").write_text("MemTotal:       16384000 kB\nMemFree:  1000 kB\n"
                                      "HugePages_Total:       0\n")
    assert meminfo(str(tmp_path / "meminfo")) == {"MemTotal": 16384000 * 1024,
                                                  "MemFree": 1000 * 1024}
