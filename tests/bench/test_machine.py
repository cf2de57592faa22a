"""What the machine lost to others during a run (kvtier.bench.machine): /proc/stat read,
spells of steal found on the run's clock, a file that is not /proc/stat."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from kvtier.bench.machine import MAX_SPELLS, MachineWatch, Sample, read_stat, summarize


def stat_line(steal: int, iowait: int = 0, idle: int = 1000) -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice
    return f"cpu  500 0 100 {idle} {iowait} 0 0 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_this_machines_stat_is_read() -> None:
    stat = read_stat()
    assert stat is not None
    total, iowait, steal = stat
    assert total > 0 and 0 <= iowait <= total and 0 <= steal <= total


def test_a_file_that_is_not_proc_stat_reads_as_nothing(tmp_path: Path) -> None:
    for text in ("", "intr 1 2 3\n", "cpu 1 2 x 4 5 6 7 8\n", "cpu 1 2 3\n"):
        (tmp_path / "stat").write_text(text)
        assert read_stat(str(tmp_path / "stat")) is None, text
    assert read_stat(str(tmp_path / "missing")) is None
    (tmp_path / "stat").write_text(stat_line(steal=7, iowait=3))
    stat = read_stat(str(tmp_path / "stat"))
    assert stat is not None and stat[1] * 7 == pytest.approx(stat[2] * 3)


def test_spells_are_the_stretches_where_steal_took_a_quarter_cpu() -> None:
    # 1 s samples; steal per second: 0, 0.1, 0.5, 1.2, 0.1, 0.3, 0
    per_second = [0.0, 0.1, 0.5, 1.2, 0.1, 0.3, 0.0]
    samples, steal = [Sample(0.0, 0.0, 0.0, 0.0)], 0.0
    for i, s in enumerate(per_second, start=1):
        steal += s
        samples.append(Sample(float(i), 2.0 * i, 0.01 * i, steal))
    out = summarize(samples)
    assert out is not None
    assert out["steal_spells"] == [[2.0, 4.0, 1.7], [5.0, 6.0, 0.3]]
    assert out["worst_steal_cpus"] == 1.2
    assert out["steal_cpu_s"] == pytest.approx(2.2)
    assert out["steal_share"] == pytest.approx(2.2 / 14.0, abs=1e-4)
    assert out["iowait_cpu_s"] == pytest.approx(0.07)
    assert summarize(samples[:1]) is None


def test_a_million_samples_of_flapping_steal_keep_the_longest_spells_in_order() -> None:
    samples, steal = [], 0.0
    for i in range(1_000_000):
        # a spell every other interval, and one long spell in the middle
        steal += 1.0 if (i % 2 or 500_000 <= i < 500_010) else 0.0
        samples.append(Sample(float(i), 2.0 * i, 0.0, steal))
    out = summarize(samples)
    assert out is not None
    spells = out["steal_spells"]
    assert len(spells) == MAX_SPELLS
    assert [499_998.0, 500_009.0, 11.0] in spells  # the longest is kept
    assert spells == sorted(spells)


def test_the_watch_samples_on_the_loop_and_summarizes_when_stopped(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(stat_line(steal=0))
    clock = iter(float(i) for i in range(1000))

    async def run() -> dict[str, object] | None:
        watch = MachineWatch(lambda: next(clock), interval_s=0.01, path=str(stat))
        watch.start()
        await asyncio.sleep(0.05)
        stat.write_text(stat_line(steal=10_000))  # 100 s of steal at 100 ticks a second
        await asyncio.sleep(0.05)
        return await watch.stop()

    out = asyncio.run(run())
    assert out is not None and out["steal_cpu_s"] == pytest.approx(10_000 / _hz())
    assert len(out["steal_spells"]) == 1  # type: ignore[arg-type]

    async def nothing() -> dict[str, object] | None:
        watch = MachineWatch(lambda: 0.0, path=str(tmp_path / "missing"))
        watch.start()
        return await watch.stop()

    assert asyncio.run(nothing()) is None


def _hz() -> float:
    import os

    return float(os.sysconf("SC_CLK_TCK"))
