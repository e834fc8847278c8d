"""Run by megascope_run.py: a tiny GPT's forward (two prompts) under activation patches, captured: a prompt
patched with its own activations, prompt 1's last residual and some of its attention heads written into
prompt 0, zero and mean ablations."""

from helpers.megascope_model import capture
from megascope.capture import CaptureSpec
from megascope.patching import Patch, Patcher

LAST = 11  # the last position of the 12-token prompts
PATCHES = {
    "plain": [],
    "own": [{"hook": "resid_post", "source": {"prompt": 0}, "prompts": [0]},
            {"hook": "attn.q", "source": {"prompt": 1}, "prompts": [1]}],
    "last_residual": [{"hook": "resid_post", "layers": [3], "positions": [LAST], "source": {"prompt": 1}}],
    # query heads 1 and 2: of groups 0 and 1 at GQA's 2 groups, so on both ranks at TP2; value head 1
    "heads": [{"hook": "attn.q", "layers": [1], "heads": [1, 2], "source": {"prompt": 1}},
              {"hook": "attn.v", "layers": [2], "heads": [1], "positions": [4, 5, 6, 7], "source": {"prompt": 1}}],
    "zero": [{"hook": "mlp.out", "layers": [2], "positions": [3, 4, 5, 6, 7], "source": "zero"}],
    "mean": [{"hook": "attn.out", "layers": [1], "source": "mean", "prompts": [0]},
             {"hook": "embed", "positions": [0], "source": "mean", "prompts": [1]}],
}


def patching_phases(chunks, tokens):
    """{phase: rank 0's records} of one forward of ``tokens`` [2, 12] under each phase's patches."""
    spec = CaptureSpec.from_json({"hooks": ["embed", "attn.q", "attn.v", "attn.out", "mlp.out", "resid_post",
                                            "logits"]})
    saved = {}
    for phase, objs in PATCHES.items():
        with Patcher(chunks, [Patch.from_json(obj) for obj in objs], 0):
            saved[phase] = capture(chunks, spec, tokens)
    return saved
