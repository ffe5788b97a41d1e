"""``strategy="persia"``: registered by importing the package (in either order with Lightning), once, with no import
hook; a shard process leaves Lightning out."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

_CHECK_REGISTERED = """
import sys
{first}
{second}
from lightning.pytorch.strategies import StrategyRegistry
assert "persia" in StrategyRegistry, sorted(StrategyRegistry)
assert not any(type(f).__module__.startswith("lightning_persia") for f in sys.meta_path), sys.meta_path
import lightning as L
trainer = L.Trainer(strategy="persia", accelerator="cpu", devices=1, logger=False)
print(type(trainer.strategy).__name__)
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "LIGHTNING_PERSIA_SHARD_PROCESS"}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=environment)


@pytest.mark.parametrize("order", [("import lightning_persia", "import lightning"), ("import lightning", "import lightning_persia")],
                         ids=["package-first", "lightning-first"])
def test_importing_the_package_registers_the_strategy_name(order):
    done = _python(_CHECK_REGISTERED.format(first=order[0], second=order[1]))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "PersiaStrategy"


def test_the_strategy_registers_its_name_in_one_place():
    import lightning_persia.strategy.persia as persia

    assert "register_strategies" not in vars(persia.PersiaStrategy), "Lightning calls register_strategies of its own strategies only"


def test_a_shard_process_imports_neither_lightning_nor_torchrec_until_asked():
    code = ("import sys, lightning_persia, lightning_persia.remote_ps.server\n"
            "print(sorted(m for m in ('lightning', 'torchrec') if m in sys.modules))\n"
            "print(lightning_persia.PersiaStrategy.__name__)")
    done = _python(code, LIGHTNING_PERSIA_SHARD_PROCESS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    loaded, name = done.stdout.strip().splitlines()[-2:]
    assert loaded == "[]" and name == "PersiaStrategy"
