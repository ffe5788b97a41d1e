"""LightningCLI's parser, naming the new place of a PersiaStrategy argument that moved into a group.

jsonargparse refuses an ``init_args`` key that the strategy's signature lacks before the strategy sees it
("Option 'ps_token' is not accepted"); this parser says where that setting lives now instead. ``lightning-persia
fit`` uses it; a LightningCLI of one's own takes it with one argument::

    LightningCLI(MyModel, parser_class=PersiaArgumentParser)
"""
from __future__ import annotations

from typing import NoReturn, Optional

from lightning.pytorch.cli import LightningArgumentParser

from lightning_persia.strategy.moved_arguments import moved_argument_reason


class PersiaArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose error for an old flat PersiaStrategy argument names its new place."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        super().error(moved_argument_reason(message) or message, ex)
