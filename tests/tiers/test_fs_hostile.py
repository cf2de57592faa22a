"""The fs tier against a hostile (or merely careless) writer of the shared folder: FIFOs,
links, folders and stray files where chunks, notes and shard folders belong.

Each story plants real entries (os.mkfifo, symlinks, folders) next to good ones and checks
that nothing blocks, every good entry is still found, and nothing outside the tier's root is
listed, opened or deleted. Calls that a regression would hang run in a thread with a deadline,
so they fail instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

from kvtier import codec
from kvtier.errors import ChunkTooLarge, NoteTooLarge
from kvtier.store.sweeper import sweep
from kvtier.tiers.fs import FsTier

from .conformance import NAMESPACE, key_of, page_buffer, read_back, sealed_chunk
from .test_fs import fs_tier

T = TypeVar("T")
DEADLINE_S = 5.0


def within(call: Callable[[], T], release: Callable[[], None] = lambda: None,
           seconds: float = DEADLINE_S) -> T:
    """``call()``'s result, failing (not hanging) if it takes longer than ``seconds``;
    ``release`` unblocks a stuck call afterwards (opens the FIFO's other end)."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        release()
        pytest.fail(f"{call} did not return within {seconds}s (blocked on a FIFO?)")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]


def unblock(fifo: Path) -> Callable[[], None]:
    """Opens the FIFO for writing, which lets a reader blocked in open() go on."""
    def release() -> None:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    return release


def chunk_path(tier: FsTier, label: str) -> Path:
    hexkey = key_of(label).hex()
    return Path(tier.root, "chunks", NAMESPACE.hex(), hexkey[:2], f"{hexkey}.kvc")


def write_good(tier: FsTier, *labels: str) -> None:
    for label in labels:
        key = key_of(label)
        tier.write(key, sealed_chunk(key))


def keys_of(tier: FsTier) -> set[bytes]:
    return {bytes(c.key) for c in tier.scan()}


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[FsTier]:
    tier = fs_tier(tmp_path / "shared")
    yield tier
    tier.close()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the tier's root, with files nothing in the tier may touch."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious").write_bytes(b"not the tier's")
    return folder


# ---------------------------------------------------------------------- FIFOs


def test_a_fifo_in_place_of_a_chunk_is_a_miss_not_a_hang(tier: FsTier) -> None:
    write_good(tier, "good")
    fifo = chunk_path(tier, "fifo")
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    got = within(lambda: tier.read_into(key_of("fifo"), page_buffer(1 << 20),
                                        namespace=NAMESPACE), unblock(fifo))
    assert got is None
    assert within(lambda: keys_of(tier)) == {bytes(key_of("good"))}
    assert tier.skipped_entries >= 1
    assert read_back(tier, key_of("good"), 1 << 20) is not None


def test_many_fifo_chunks_do_not_exhaust_the_io_threads(tier: FsTier) -> None:
    labels = [f"fifo {i}" for i in range(64)]
    for label in labels:
        chunk_path(tier, label).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(chunk_path(tier, label))

    def read_all() -> list[int | None]:
        with ThreadPoolExecutor(4) as pool:  # as few threads as a tier's I/O pool
            return list(pool.map(lambda label: tier.read_into(
                key_of(label), page_buffer(1 << 16), namespace=NAMESPACE), labels))

    def release() -> None:
        for label in labels:
            unblock(chunk_path(tier, label))()

    assert within(read_all, release) == [None] * len(labels)


def test_a_fifo_in_place_of_a_note_is_none_and_left_out_of_listings(tier: FsTier) -> None:
    good = "journal/0000000000001-a-000001"
    tier.put_note(good, b"records")
    fifo = Path(tier.root, "notes", "journal", "0000000000002-b-000001")
    os.mkfifo(fifo)
    assert within(lambda: tier.get_note("journal/0000000000002-b-000001"),
                  unblock(fifo)) is None
    assert within(lambda: tier.list_notes("journal/")) == [good]
    assert tier.get_note(good) == b"records"


def test_a_sweep_finishes_among_fifos_folders_and_stray_files(tier: FsTier) -> None:
    """The job that stopped for good on every server: budgets, notes, temps."""
    write_good(tier, "old", "new")
    for name in ("journal/0000000000003-c-000001", "servers/hostile"):
        path = Path(tier.root, "notes", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
    Path(tier.root, "notes", "journal", "0000000000004-d-000001").mkdir()
    os.mkfifo(Path(tier.root, "tmp", "stuck.tmp"))
    chunk_path(tier, "fifo chunk").parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(chunk_path(tier, "fifo chunk"))
    Path(tier.root, "chunks", NAMESPACE.hex(), "stray").write_bytes(b"x")
    tier.put_note("journal/0000000000001-a-000001", b"old note")
    report = within(lambda: sweep(tier, capacity=1 << 30, now=time.time()), seconds=20)
    assert report.usage[NAMESPACE] == 2 * len(sealed_chunk(key_of("old")))
    assert tier.get_note("journal/0000000000001-a-000001") is None, "old notes still swept"


# ---------------------------------------------------------------------- stray entries


def test_stray_files_and_folders_never_fail_a_listing(tier: FsTier) -> None:
    write_good(tier, "one", "two", "three")
    notes = ["journal/0000000000001-a-000001", "journal/0000000000002-a-000002"]
    for name in notes:
        tier.put_note(name, b"n")
    chunks = Path(tier.root, "chunks")
    (chunks / "not-a-namespace").mkdir()
    (chunks / ("ab" * 32)).write_bytes(b"a file named like a namespace")
    ns = chunks / NAMESPACE.hex()
    (ns / "stray").write_bytes(b"a file where shard folders go")
    (ns / "zz").mkdir()
    shard = chunk_path(tier, "one").parent
    (shard / "notes.txt").write_bytes(b"a file that is no chunk")
    (shard / f"{'f' * 64}.kvc").write_bytes(b"a chunk name in the wrong shard")
    (shard / f"{key_of('folder').hex()[:2]}{'0' * 62}.kvc").mkdir()  # a folder named as chunk
    journal = Path(tier.root, "notes", "journal")
    (journal / "0000000000003-b-000001").mkdir()  # a folder named like a journal note
    (journal / "bad name with spaces").write_bytes(b"x")
    (journal / "line\nbreak").write_bytes(b"x")
    before = tier.skipped_entries

    assert tier.namespaces() == [NAMESPACE]
    assert keys_of(tier) == {bytes(key_of(label)) for label in ("one", "two", "three")}
    assert [c.key for c in tier.scan_namespace(NAMESPACE)] != []
    assert tier.list_notes("journal/") == notes
    assert tier.get_note("journal/0000000000003-b-000001") is None  # a folder: no note
    tier.delete_note("journal/0000000000003-b-000001")  # not removed, not an error
    assert (journal / "0000000000003-b-000001").is_dir()
    assert tier.skipped_entries - before >= 9


def test_list_notes_honours_limit_and_start_after(tier: FsTier) -> None:
    names = [f"journal/{i:013d}-s-{i:06d}" for i in range(30)]
    for name in reversed(names):
        tier.put_note(name, b"x")
    assert tier.list_notes("journal/", limit=10) == names[:10]
    assert tier.list_notes("journal/", start_after=names[9], limit=5) == names[10:15]
    assert tier.list_notes("journal/", limit=0) == []
    assert tier.list_notes("journal/") == names


# ---------------------------------------------------------------------- links


def test_a_linked_shard_folder_is_never_listed_opened_deleted_or_written_through(
        tier: FsTier, outside: Path) -> None:
    write_good(tier, "inside")
    victim = key_of("outside")
    hexkey = victim.hex()
    planted = outside / f"{hexkey}.kvc"  # a valid chunk, in a folder outside the root
    shutil.copyfile(chunk_path(tier, "inside"), planted)
    shard = Path(tier.root, "chunks", NAMESPACE.hex(), hexkey[:2])
    if shard.exists():
        pytest.skip("the two labels share a shard")
    shard.symlink_to(outside, target_is_directory=True)

    assert keys_of(tier) == {bytes(key_of("inside"))}
    assert tier.read_into(victim, page_buffer(1 << 20), namespace=NAMESPACE) is None
    tier.delete(victim, namespace=NAMESPACE)
    tier.touch(victim, namespace=NAMESPACE)
    tier.write(victim, sealed_chunk(victim))  # the link itself is replaced, never written
    assert planted.exists() and (outside / "precious").read_bytes() == b"not the tier's"
    assert sorted(os.listdir(outside)) == sorted(["precious", planted.name])
    assert shard.is_dir() and not shard.is_symlink()
    assert keys_of(tier) == {bytes(key_of("inside")), bytes(victim)}


def test_linked_namespace_notes_and_temp_entries_stay_outside(tier: FsTier, outside: Path
                                                               ) -> None:
    other_ns = "cd" * 32
    Path(tier.root, "chunks", other_ns).symlink_to(outside, target_is_directory=True)
    Path(tier.root, "notes", "servers").symlink_to(outside, target_is_directory=True)
    journal = Path(tier.root, "notes", "journal")
    journal.mkdir()
    (journal / "0000000000001-a-000001").symlink_to(outside / "precious")
    old = time.time() - 7200
    os.utime(outside / "precious", (old, old))
    Path(tier.root, "tmp", "old.tmp").symlink_to(outside / "precious")
    Path(tier.root, "tmp", "old-folder").mkdir()

    assert tier.namespaces() == []
    assert list(tier.scan_namespace(bytes.fromhex(other_ns))) == []
    assert tier.list_notes("servers/") == [] and tier.list_notes("journal/") == []
    assert tier.get_note("journal/0000000000001-a-000001") is None
    assert tier.get_note("servers/precious") is None
    tier.delete_note("servers/precious")
    tier.delete_note("journal/0000000000001-a-000001")  # the link itself goes, at most
    tier.clean_stale_temps(60)
    assert (outside / "precious").read_bytes() == b"not the tier's"
    assert not (journal / "0000000000001-a-000001").is_symlink()
    assert Path(tier.root, "tmp", "old-folder").is_dir()  # never removed recursively


def test_a_link_in_place_of_a_chunk_is_a_miss_and_only_the_link_is_deleted(
        tier: FsTier, outside: Path) -> None:
    write_good(tier, "real")
    link = chunk_path(tier, "link")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(chunk_path(tier, "real"))
    assert tier.read_into(key_of("link"), page_buffer(1 << 20), namespace=NAMESPACE) is None
    assert keys_of(tier) == {bytes(key_of("real"))}
    tier.delete(key_of("link"), namespace=NAMESPACE)
    assert not link.is_symlink() and read_back(tier, key_of("real"), 1 << 20) is not None


# ---------------------------------------------------------------------- sizes


def test_an_oversized_note_raises_without_being_read(tier: FsTier) -> None:
    huge = Path(tier.root, "notes", "journal", "0000000000001-a-000001")
    huge.parent.mkdir(parents=True, exist_ok=True)
    with open(huge, "wb") as f:
        f.truncate(2 << 30)  # sparse: 2 GiB that a read would have to hold
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    with pytest.raises(NoteTooLarge, match="2147483648 bytes"):
        tier.get_note("journal/0000000000001-a-000001")
    assert time.monotonic() - started < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 256 << 10  # KiB
    tier.put_note("servers/a", b"x" * 100)
    with pytest.raises(NoteTooLarge):
        tier.get_note("servers/a", max_bytes=99)
    assert tier.get_note("servers/a", max_bytes=100) == b"x" * 100


def test_an_oversized_chunk_is_too_large_before_it_is_read(tier: FsTier) -> None:
    path = chunk_path(tier, "huge")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(2 << 30)
    started = time.monotonic()
    with pytest.raises(ChunkTooLarge):
        tier.read_into(key_of("huge"), page_buffer(64 * codec.PAGE), namespace=NAMESPACE)
    assert time.monotonic() - started < 1.0
