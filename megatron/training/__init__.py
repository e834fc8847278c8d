"""MegatronApp's training layer on megatron-core (what Megatron-LM keeps outside the core).

Importing this package first silences megatron-core's notices that concern none of our runs:
on import, that Transformer Engine / Apex are missing (both optional: megatron-core falls back to
PyTorch), and on each tokenizer, that the legacy tokenizer interface is deprecated (its datasets
still read that interface). Everything else megatron-core says stays visible.

It also ties this process's life to its parent's, and that of what it forks to its own (job_lifetime.py): first,
so that a launcher killed while a rank still imports ends the rank too.
"""

import logging
import warnings

from megatron.training.job_lifetime import end_with_parent

end_with_parent()

warnings.filterwarnings("ignore", message=r"Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message=r"Apex is not installed")
logging.getLogger("megatron.core.datasets.megatron_tokenizer").setLevel(logging.ERROR)
