"""The faults that show every component of the moved state counts, and their effect.

For each positional component of a side (and each kind of buffer inside the mixed
ones) there is a fault: the component left out of the copy, or its rows landing one
ring position off. :func:`sensitivity` runs each against a fault-free continuation
and reports what changed; the tests assert that something always does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbeam.pools.layout import build_side_layout
from kvbeam.pools.spec import SideConfig
from kvbeam.refengine.engine import Continuation
from kvbeam.refengine.run import SplitRun


@dataclass(frozen=True)
class Fault:
    """``skip`` or ``shift`` the named component / buffer kind / buffer pattern."""

    action: str
    name: str

    @property
    def draft_only(self) -> bool:
        """A draft fault may change only the draft's proposals, never the target's tokens."""
        return self.name.startswith("draft.")

    def __str__(self) -> str:
        return f"{self.action} {self.name}"


def component_faults(config: SideConfig) -> list[Fault]:
    """Every fault worth trying on ``config``'s layout, component by component."""
    layout = build_side_layout(config)
    spec = config.target
    out = []
    for comp in layout.components:
        out.append(Fault("skip", comp.name))
        if comp.name == "kv":
            out += [Fault("skip", f"c{r}_kv") for r in (4, 128) if r in spec.compression_ratios]
            if 4 in spec.compression_ratios:
                out.append(Fault("skip", "c4_indexer"))
        elif comp.name == "target.swa":
            if not spec.unified_kv:
                out += [Fault("skip", "target.layer*.swa"), Fault("shift", "target.layer*.swa")]
            if 4 in spec.compression_ratios:
                out += [Fault(a, k) for k in ("c4_state", "c4_indexer_state")
                        for a in ("skip", "shift")]
        elif comp.name == "target.c128_state":
            if not spec.online_c128:  # an online state is one row: nothing to shift
                out.append(Fault("shift", "c128_state"))
        else:  # the unified ring, the draft's ring or pages
            out.append(Fault("shift", comp.name))
    return out


@dataclass(frozen=True)
class Effect:
    """What one fault changed in a ``k``-token continuation."""

    fault: Fault
    tokens_changed: int
    proposals_changed: int
    max_logit_diff: float

    @property
    def changed(self) -> bool:
        """The continuation differs: tokens or draft proposals."""
        return self.tokens_changed > 0 or self.proposals_changed > 0


def sensitivity(split: SplitRun, k: int, faults: list[Fault] | None = None,
                clean: Continuation | None = None) -> list[Effect]:
    """Run each fault (default: :func:`component_faults`) against the clean continuation.

    Decode pools start zeroed so that a fault shows as different tokens, not NaN.
    ``clean`` is the fault-free continuation when the caller already has it.
    """
    if clean is None:
        clean = split.decode(k, garbage=False)
    out = []
    for f in faults if faults is not None else component_faults(split.config):
        c = (split.decode(k, garbage=False, skip=(f.name,)) if f.action == "skip"
             else split.decode(k, garbage=False, shift=(f.name,)))
        out.append(Effect(
            f,
            sum(a != b for a, b in zip(c.tokens, clean.tokens, strict=True)),
            sum(a != b for a, b in zip(c.proposals, clean.proposals, strict=True)),
            float((c.logits - clean.logits).abs().max()),
        ))
    return out


def format_effects(effects: list[Effect], k: int) -> str:
    """A markdown table of fault effects."""
    lines = ["| fault | tokens changed | proposals changed | max logit diff |",
             "|---|---|---|---|"]
    for e in effects:
        lines.append(f"| {e.fault} | {e.tokens_changed}/{k} | {e.proposals_changed}/{k} | "
                     f"{e.max_logit_diff:.3g} |")
    return "\n".join(lines)
