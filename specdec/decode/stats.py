"""Speculative decoding statistics, per run and per sequence.

Conventions (shared/REFERENCE.md):
- acceptance_rate = accepted drafts / drafted tokens.
- mean_accepted_tokens = tokens emitted per (sequence, round), bonus/recovered token
  included, so plain decoding is 1.0.
- per_position_acceptance[i] = P(draft i+1 accepted | it was drafted).
- alpha = per-token acceptance estimated under the i.i.d. model (accepted drafts over
  accepted drafts + rejections), the alpha of E = (1 - alpha^(k+1)) / (1 - alpha).
- verify_width_per_round: tokens per sequence in each verification forward (T = k + 1
  for a chain, the largest tree's nodes for a tree round).
- alpha_dist = the mean over drafted positions of the distribution-level acceptance
  alpha_i = sum_x min(p_i(x), q_i(x)) (specdec.decode.speculative.draft_alpha; q one-hot on
  the draft for drafters without probabilities, p one-hot on the argmax when greedy).
  alpha_dist_examined = its mean over the positions the rule examined (up to and including
  the first rejection; accepted + rejections of them). Under lossless speculative sampling
  an examined draft is accepted with probability alpha_i, so E[accepted] = E[sum of alpha_i
  over examined positions]: `alpha` is the empirical estimate of alpha_dist_examined. The
  positions after a rejection (in alpha_dist, never in `alpha`) are scored on a prefix
  holding the rejected draft. Per sequence: alpha_dist_per_round = the sum of alpha_i over
  the round's drafted positions (drafted_per_round of them), alpha_dist_examined_per_round
  the sum over its examined ones (min(accepted + 1, drafted)). Chain rounds only: None /
  empty for tree rounds.
- Tree rounds record the tree depth as "drafted", so per_position_acceptance[d] is the
  acceptance at depth d + 1 (also given as acceptance_per_depth), accepted_per_round the
  accepted path length; tree_nodes_per_round: draft nodes (root excluded) per
  (sequence, round).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    emitted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    drafted_per_round: list[int] = field(default_factory=list)
    emitted_per_round: list[int] = field(default_factory=list)
    alpha_dist_per_round: list[float] = field(default_factory=list)  # sums, module docstring
    alpha_dist_examined_per_round: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_accepted_tokens": self.emitted / self.rounds if self.rounds else 0.0,
            "accepted_per_round": self.accepted_per_round,
            "drafted_per_round": self.drafted_per_round,
            "emitted_per_round": self.emitted_per_round,
            "rejections": self.rejections,
            "alpha_dist_per_round": [round(a, 6) for a in self.alpha_dist_per_round],
            "alpha_dist_examined_per_round": [
                round(a, 6) for a in self.alpha_dist_examined_per_round
            ],
        }


class SpecStats:
    def __init__(self, batch: int):
        self.seqs = [SeqStats() for _ in range(batch)]
        self.pos_drafted: list[int] = []
        self.pos_accepted: list[int] = []
        self.target_forwards = 0
        self.draft_forwards = 0
        self.time = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "other": 0.0}
        self.verify_widths: list[int] = []
        self.tree_nodes: list[int] | None = None  # set by the first tree round

    def record_verify(self, width: int) -> None:
        """One verification forward over `width` tokens per sequence."""
        self.verify_widths.append(width)

    def record_tree(self, nodes: list[int]) -> None:
        """Draft nodes (root excluded) of the active sequences' trees in one round."""
        self.tree_nodes = (self.tree_nodes or []) + nodes

    def record(
        self,
        b: int,
        n_draft: int,
        n_accepted: int,
        n_emitted: int,
        alpha: list[float] | None = None,
    ) -> None:
        """One round of sequence b; alpha: its n_draft values alpha_i (chain rounds)."""
        s = self.seqs[b]
        s.rounds += 1
        s.drafted += n_draft
        s.accepted += n_accepted
        s.rejections += int(n_accepted < n_draft)
        s.emitted += n_emitted
        s.accepted_per_round.append(n_accepted)
        s.drafted_per_round.append(n_draft)
        s.emitted_per_round.append(n_emitted)
        while len(self.pos_drafted) < n_draft:
            self.pos_drafted.append(0)
            self.pos_accepted.append(0)
        for i in range(n_draft):
            self.pos_drafted[i] += 1
            self.pos_accepted[i] += int(i < n_accepted)
        if alpha is not None:
            s.alpha_dist_per_round.append(sum(alpha))
            s.alpha_dist_examined_per_round.append(sum(alpha[: n_accepted + 1]))

    def summary(self, elapsed_s: float, generated: int) -> dict:
        rounds = sum(s.rounds for s in self.seqs)
        drafted = sum(s.drafted for s in self.seqs)
        accepted = sum(s.accepted for s in self.seqs)
        rejections = sum(s.rejections for s in self.seqs)
        emitted = sum(s.emitted for s in self.seqs)
        t = dict(self.time)
        t["other"] = max(0.0, elapsed_s - t["prefill"] - t["draft"] - t["verify"])
        widths, nodes = self.verify_widths, self.tree_nodes
        alpha_all = [a for s in self.seqs for a in s.alpha_dist_per_round]
        alpha_seen = [a for s in self.seqs for a in s.alpha_dist_examined_per_round]
        measured = bool(alpha_all)  # alpha_i is recorded for chain rounds only
        per_position = [a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)]
        tree = {}
        if nodes is not None:
            tree = {
                "mean_tree_nodes": sum(nodes) / len(nodes) if nodes else 0.0,
                "tree_nodes_per_round": nodes,
                "acceptance_per_depth": per_position,
            }
        return {
            "rounds": rounds,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "alpha": accepted / (accepted + rejections) if accepted + rejections else 0.0,
            "alpha_dist": sum(alpha_all) / drafted if measured and drafted else None,
            "alpha_dist_examined": (
                sum(alpha_seen) / (accepted + rejections)
                if measured and accepted + rejections
                else None
            ),
            "mean_accepted_tokens": emitted / rounds if rounds else 0.0,
            "per_position_acceptance": per_position,
            "mean_accepted_path": accepted / rounds if rounds else 0.0,
            "mean_verify_width": sum(widths) / len(widths) if widths else 0.0,
            "verify_width_per_round": widths,
            **tree,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "time_s": t,
            "generated": generated,
            "tokens_per_second": generated / elapsed_s if elapsed_s > 0 else 0.0,
            "per_sequence": [s.as_dict() for s in self.seqs],
        }
