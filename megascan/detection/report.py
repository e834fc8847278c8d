"""The detection report: ranked suspects with evidence, as text for people and JSON for tools."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

BLOCKED_LISTED = 16  # the text report lists this many blocked ranks; the JSON has all
DELAY_PREFIX = "delay it caused: "  # a slow rank's first line of evidence: its cost to the job (Suspect.delay_us)


def _blocked_line(entry):
    line = f"rank {entry['rank']}: in {entry['operation']}, waiting for rank(s) {entry['waits_for']}"
    if entry["behind"] != entry["waits_for"]:
        line += f", behind hung rank(s) {entry['behind']}" if entry["behind"] else ", in a cycle (deadlock)"
    return line


@dataclass
class Suspect:
    rank: int
    coords: dict
    host: str
    device_index: object
    kind: str  # "slow_rank", "hang" or (Report.host_bound) "host_bound"
    score: float
    evidence: list = field(default_factory=list)
    # What it made the traced iterations longer (a slow rank's; nan for others), as its DELAY_PREFIX line says
    delay_us: float = float("nan")

    def title(self) -> str:
        c = self.coords
        device = f", GPU {self.device_index}" if self.device_index is not None else ""
        return f"rank {self.rank} (DP{c['dp']} PP{c['pp']} TP{c['tp']}, host {self.host}{device})"


@dataclass
class Report:
    suspects: list
    victims: list  # [{rank, coords, waited_us, waited_for (the suspects' ranks), note}]
    links: list
    alignment: dict  # rank -> residual_us, of every rank judged
    unjudged: list  # [{who, why}]: not judged, or judged on part of the run only
    blocked: list = field(default_factory=list)  # [{rank, coords, operation, waits_for, behind}] in a hang
    host_bound: list = field(default_factory=list)  # Suspect (kind "host_bound"): its host, not its GPU, was late
    traced_us: float = 0.0  # the traced iterations' length (their critical paths together)
    iterations: int = 0  # how many traced iterations were judged

    def to_json(self) -> dict:
        return asdict(self)

    def drop_suspects(self, ranks: set[int]) -> None:
        """The report without the suspects of ``ranks``, nor the victims that waited for none but them."""
        self.suspects = [suspect for suspect in self.suspects if suspect.rank not in ranks]
        self.victims = [victim for victim in self.victims if not set(victim["waited_for"]) <= ranks]

    def headline(self) -> str | None:
        """The first suspect and why in one line (an alert's, a window's verdict), or None when it names nobody."""
        if not self.suspects:
            return None
        first = self.suspects[0]
        label = "hung" if first.kind == "hang" else first.kind.replace("_", " ")
        more = f" (+{len(self.suspects) - 1} more suspect(s))" if len(self.suspects) > 1 else ""
        why = first.evidence[0] if first.evidence else ""
        return f"{first.title()}: {label}, score {first.score:.2f}{more}; {why}"

    def to_text(self) -> str:
        lines = []
        judged = f" among the {len(self.alignment)} ranks judged" if self.unjudged else ""
        slow_links = any(link["slow"] for link in self.links)
        if not self.suspects and slow_links:
            lines.append(f"MegaScan detection: no slow or hung rank{judged}; a slow link (below).")
        elif not self.suspects:
            lines.append(f"MegaScan detection: no suspect{judged} (no rank is slow, no link is slow, no rank hung).")
        else:
            lines.append(f"MegaScan detection: {len(self.suspects)} suspect(s){judged}, most likely first")
        if self.unjudged:  # beside the verdict: it says nothing about these
            lines.append("Not judged (no verdict on them):")
            lines += [f"   {entry['who']}: {entry['why']}" for entry in self.unjudged]
        for place, suspect in enumerate(self.suspects, 1):
            label = "hung" if suspect.kind == "hang" else suspect.kind.replace("_", " ")
            lines.append(f"{place}. {suspect.title()}: {label}, score {suspect.score:.2f}")
            lines += [f"     - {line}" for line in suspect.evidence]
        if self.host_bound:
            lines.append("Host-bound (not a slow GPU: their device waited for their own host, and others for them):")
            for suspect in self.host_bound:
                lines.append(f"   {suspect.title()}: host-bound, score {suspect.score:.2f}")
                lines += [f"     - {line}" for line in suspect.evidence]
        if self.victims:
            lines.append("Victims (they waited for a suspect):")
            lines += [f"   rank {v['rank']}: {v['note']}" for v in self.victims]
        if self.blocked:
            lines.append(f"Blocked (not hung: each waits, directly or through others, for a hung rank): "
                         f"{len(self.blocked)} rank(s)")
            lines += [f"   {_blocked_line(entry)}" for entry in self.blocked[:BLOCKED_LISTED]]
            if len(self.blocked) > BLOCKED_LISTED:
                lines.append(f"   ... and {len(self.blocked) - BLOCKED_LISTED} more (all in --report-json)")
        slow = [link for link in self.links if link["slow"]]
        for link in slow:
            lines.append(f"Slow link {link['src']} -> {link['dst']}: {link['bandwidth_gbps']:.2f} GB/s, "
                         f"median latency {link['median_latency_us']:.0f} us over {link['transfers']} transfers; "
                         f"its transfers on the critical path took {link['critical_path_delay_us'] / 1e3:.1f} ms "
                         f"longer than the same transfers on other links")
        return "\n".join(lines)
