"""The strategy's arguments that moved into a group, and the message that names the new place of each.

``PersiaStrategy`` once took every table setting, parameter-server setting and metrics setting flat. They are
grouped now, each group one typed, documented dataclass: ``tables`` (:class:`TableSettings`), ``ps``
(:class:`PSSettings`: an old ``ps_<x>`` is ``ps.<x>``) and ``metrics`` (:class:`MetricsEndpoint`: an old
``metrics_<x>`` is ``metrics.<x>``). An old name fails with a message naming its new place, in Python
(:func:`refuse_moved_arguments`) and in a LightningCLI YAML or command line (:func:`moved_argument_reason`, read by
``lightning_persia.strategy.cli_parser``).
"""
from __future__ import annotations

import re
from typing import Iterable, NamedTuple, Optional

from lightning_persia.remote_ps.table_config import TABLE_SETTING_NAMES


class NewPlace(NamedTuple):
    argument: str  # the strategy's argument that holds the group
    group: str     # the group's class
    field: str     # the field of the group


_PS_FIELDS = {"ps_addresses": "addresses", "num_local_shards": "num_local_shards", "ps_seed": "seed", "ps_config": "config",
              "ps_token": "token", "ps_tls_root_cert": "tls_root_cert", "ps_timeout_s": "timeout_s"}

MOVED: dict[str, NewPlace] = {
    **{name: NewPlace("tables", "TableSettings", name) for name in TABLE_SETTING_NAMES},
    **{old: NewPlace("ps", "PSSettings", new) for old, new in _PS_FIELDS.items()},
    "metrics_port": NewPlace("metrics", "MetricsEndpoint", "port"),
    "metrics_host": NewPlace("metrics", "MetricsEndpoint", "host"),
}
"""Old flat argument name -> where it lives now."""


def moved_arguments_message(names: Iterable[str]) -> str:
    """What to write instead of ``PersiaStrategy(<names>=...)``, in Python and in YAML."""
    names = [name for name in names if name in MOVED]
    groups: dict[NewPlace, list[str]] = {}
    for name in names:
        place = MOVED[name]
        groups.setdefault(NewPlace(place.argument, place.group, ""), []).append(place.field)
    python = ", ".join(f"{group.argument}={group.group}({', '.join(f'{field}=...' for field in fields)})" for group, fields in groups.items())
    yaml = ", ".join(f"init_args.{MOVED[name].argument}.{MOVED[name].field}" for name in names)
    per_table = " (or per table: table_overrides)" if any(MOVED[name].argument == "tables" for name in names) else ""
    given = ", ".join(f"{name}=..." for name in names)
    return f"PersiaStrategy({given}) moved: PersiaStrategy({python}); in YAML {yaml}{per_table}"


def refuse_moved_arguments(kwargs: dict) -> None:
    """Raises ``TypeError`` naming the new place of every old flat argument in ``kwargs`` (which would reach DDP)."""
    moved = [name for name in kwargs if name in MOVED]
    if moved:
        raise TypeError(moved_arguments_message(moved))


# jsonargparse's report of an init_args key the class's signature does not have
_NOT_ACCEPTED = re.compile(r"class_path '[\w.]*PersiaStrategy':\s+Option '(\w+)' is not accepted")


def moved_argument_reason(parser_message: str) -> Optional[str]:
    """The reason to give instead of jsonargparse's ``Option 'ps_token' is not accepted`` for PersiaStrategy's
    init_args, when the refused option is one that moved; ``None`` for any other message."""
    refused = _NOT_ACCEPTED.search(parser_message)
    if refused is None or refused.group(1) not in MOVED:
        return None
    return f"lightning_persia.PersiaStrategy: {moved_arguments_message([refused.group(1)])}"
