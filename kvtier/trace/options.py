"""Command-line values turned into typed simulator settings, with clear errors.

``--tier NAME=SIZE[:eviction=NAME][:admission=RULES][:write=through|back]`` names a tier; the
first must be ``host``, which takes ``free_target=F`` instead of admission and write (the
store's ``arena.free_target``, default 0.05). ``RULES`` is ``always`` or ``rule=N`` joined by
``,`` or ``+`` (for example ``after_uses=2+min_prefix_tokens=2048``). Options left out take
the command's ``--eviction``, ``--admission`` and ``--write-policy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvtier.errors import ConfigError
from kvtier.policies import ADMISSION, EVICTION
from kvtier.trace.simulate import DEFAULT_FREE_TARGET, HOST, TierSpec, WritePolicy
from kvtier.trace.sizes import size_chunks

Rules = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class TierArg:
    name: str
    size: str
    eviction: str | None = None
    admission: Rules | None = None
    write: WritePolicy | None = None
    free_target: float | None = None


def parse_admission(text: str, where: str = "--admission") -> Rules:
    raw = text.strip()
    if raw in ("", "always"):
        return ()
    rules = []
    for part in raw.replace("+", ",").split(","):
        name, sep, value = part.strip().partition("=")
        if name not in ADMISSION:
            raise ConfigError(f"{where}: unknown admission rule {name!r}; known: {list(ADMISSION)}")
        if not sep or not value.strip().isdigit():
            raise ConfigError(f"{where}: {name} needs a non-negative integer, as in {name}=2")
        if name != "always":
            rules.append((name, int(value)))
    return tuple(rules)


def parse_eviction(text: str, where: str = "--eviction") -> str:
    if text not in EVICTION:
        raise ConfigError(f"{where}: unknown eviction policy {text!r}; known: {list(EVICTION)}")
    return text


def parse_tier(text: str) -> TierArg:
    head, *options = text.split(":")
    name, sep, size = head.partition("=")
    if not sep or not name or not size:
        raise ConfigError(f"--tier {text!r}: expected NAME=SIZE, as in host=3Mtok or disk=2TiB")
    where = f"--tier {name}"
    arg = TierArg(name, size)
    for option in options:
        key, sep, value = option.partition("=")
        if key == "eviction" and sep:
            arg = replace(arg, eviction=parse_eviction(value, where))
        elif key == "admission" and sep:
            arg = replace(arg, admission=parse_admission(value, where))
        elif key == "write" and value in ("through", "back"):
            arg = replace(arg, write="through" if value == "through" else "back")
        elif key == "free_target" and sep:
            arg = replace(arg, free_target=parse_share(value, f"{where}: free_target"))
        else:
            raise ConfigError(
                f"{where}: bad option {option!r}; allowed: eviction=NAME, admission=RULES, "
                "write=through|back (lower tiers), free_target=F (host)"
            )
    return arg


def parse_share(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{where} must be a number in [0, 1), got {text!r}")
    return value


def build_specs(
    tiers: Sequence[TierArg],
    *,
    eviction: str,
    admission: Rules,
    write: WritePolicy,
    block_tokens: int,
    bytes_per_token: int | None,
) -> tuple[list[TierSpec], frozenset[str]]:
    """The tier specs, and the names of tiers whose eviction policy was chosen per tier."""
    if not tiers or tiers[0].name != HOST:
        raise ConfigError("the first --tier must be the host tier, as in --tier host=3Mtok")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ConfigError(f"--tier names must be unique, got {names}")
    if tiers[0].admission is not None or tiers[0].write is not None:
        raise ConfigError("--tier host: admission and write apply to lower tiers only")
    if any(t.free_target is not None for t in tiers[1:]):
        raise ConfigError("--tier: free_target applies to the host tier only")
    specs = [_spec(t, eviction, admission, write, block_tokens, bytes_per_token) for t in tiers]
    explicit = frozenset(t.name for t in tiers if t.eviction is not None)
    return specs, explicit


def _spec(
    t: TierArg, eviction: str, admission: Rules, write: WritePolicy, bt: int, bpt: int | None
) -> TierSpec:
    capacity = size_chunks(t.size, bt, bpt, f"--tier {t.name}")
    lower = t.name != HOST
    return TierSpec(
        name=t.name,
        capacity=capacity,
        eviction=t.eviction or eviction,
        admission=(t.admission if t.admission is not None else admission) if lower else (),
        write=(t.write or write) if lower else "through",
        free_target=DEFAULT_FREE_TARGET if t.free_target is None else t.free_target,
    )
