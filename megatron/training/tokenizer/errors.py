"""The one error type every tokenizer load or use failure raises."""

from megatron.training.errors import UserError


class TokenizerError(UserError, ValueError):
    """A tokenizer could not be built or could not handle its input.

    The message is one line that names the flag or file at fault and says what to do, so that a
    command-line tool (and the training entry points, through ``UserError``) can print it as is.
    """
