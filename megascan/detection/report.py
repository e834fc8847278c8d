"""The detection report: ranked suspects with evidence, as text for people and JSON for tools."""

from dataclasses import asdict, dataclass, field


@dataclass
class Suspect:
    rank: int
    coords: dict
    host: str
    device_index: object
    kind: str  # "slow_rank" or "hang"
    score: float
    evidence: list = field(default_factory=list)

    def title(self):
        c = self.coords
        device = f", GPU {self.device_index}" if self.device_index is not None else ""
        return f"rank {self.rank} (DP{c['dp']} PP{c['pp']} TP{c['tp']}, host {self.host}{device})"


@dataclass
class Report:
    suspects: list
    victims: list  # [{rank, coords, waited_us, note}]
    links: list
    alignment: dict  # rank -> residual_us, of every rank judged
    unjudged: list  # [{who, why}]: not judged, or judged on part of the run only

    def to_json(self):
        return asdict(self)

    def to_text(self):
        lines = []
        judged = f" among the {len(self.alignment)} ranks judged" if self.unjudged else ""
        if not self.suspects:
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
        if self.victims:
            lines.append("Victims (they lag only because they wait):")
            lines += [f"   rank {v['rank']}: {v['note']}" for v in self.victims]
        slow = [link for link in self.links if link["slow"]]
        for link in slow:
            lines.append(f"Slow link {link['src']} -> {link['dst']}: {link['bandwidth_gbps']:.2f} GB/s, "
                         f"median latency {link['median_latency_us']:.0f} us over {link['transfers']} transfers")
        return "\n".join(lines)
