"""`lightning-persia ps serve`: printed address, YAML + dotlist config, parent death, argument errors."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from lightning_persia import cli
from lightning_persia.remote_ps.client import PSClient
from lightning_persia.remote_ps.protocol import LISTENING_PREFIX
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.table_config import Adagrad, Normal, SGD, TableConfig

SERVE = [sys.executable, "-m", "lightning_persia.cli", "ps", "serve", "--port", "0", "--shard-index", "0", "--num-shards", "1"]


def _gone(pid: int, timeout_s: float) -> bool:
    """True once ``pid`` has exited (a zombie counts as exited) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_port_zero_prints_the_address_and_the_shard_exits_with_its_parent():
    parent = subprocess.Popen(["sleep", "60"])
    shard = subprocess.Popen([*SERVE, "--parent-pid", str(parent.pid)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # a parent that starts a shard and dies at once: the shard goes with it
    orphan_script = (
        "import os, subprocess\n"
        f"command = {SERVE!r} + ['--parent-pid', str(os.getpid())]\n"
        "shard = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)\n"
        "print(shard.pid, shard.stdout.readline().strip(), flush=True)\n"
    )
    orphaner = subprocess.run([sys.executable, "-c", orphan_script], capture_output=True, text=True, timeout=120)
    try:
        line = shard.stdout.readline().rstrip("\n")
        match = re.fullmatch(rf"{LISTENING_PREFIX} (127\.0\.0\.1:(\d+))", line)
        assert match and int(match.group(2)) > 0, line
        with PSClient([match.group(1)]) as client:
            client.wait_healthy(30)
            assert client.stats()[0]["num_shards"] == 1

        parent.kill()
        parent.wait()
        assert shard.wait(15) == 0
        assert "parent process" in shard.stderr.read()

        orphan_pid, orphan_line = orphaner.stdout.split(" ", 1)
        assert orphan_line.startswith(LISTENING_PREFIX)
        assert _gone(int(orphan_pid), 15)
    finally:
        for process in (parent, shard):
            if process.poll() is None:
                process.kill()
                process.wait()


def test_yaml_env_interpolation_and_dotlist_overrides(ps_cluster1, make_client, ps_seed):
    client = make_client(ps_cluster1.addresses)
    tables = client.describe()
    assert tables["yaml_table"] == TableConfig("yaml_table", 12, optimizer=Adagrad(lr=0.5, rowwise=True), init=Normal(std=0.1))
    assert tables["small"] == TableConfig("small", 4, optimizer=SGD(lr=1.0))
    # seed: ${oc.env:PERSIA_TEST_PS_SEED} -> the rows of an in-process store with that seed
    ids = torch.arange(-50, 50)
    reference = ShardStore(0, 1, seed=ps_seed, table_defaults={"yaml_table": tables["yaml_table"]})
    got = client.lookup({"yaml_table": ids}, train=False, wire_dtype="fp32")["yaml_table"]
    assert torch.equal(got, reference.lookup("yaml_table", ids, train=False))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["ps", "serve", "--port", "0", "--shard-index", "2", "--num-shards", "2"], "--shard-index must be in [0, --num-shards=2)"),
        (["ps", "serve", "--port", "0", "--shard-index", "0", "--num-shards", "1", "--tls-cert", "x.pem"], "--tls-cert and --tls-key go together"),
        (["ps", "serve", "--shard-index", "0", "--num-shards", "1"], "the following arguments are required: --port"),
        (["ps"], "the following arguments are required: {serve,scale}"),
    ],
)
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("setting", [["--copy-share", "0"], ["--wave-rows", "0"], ["--max-rounds", "-1"]])
def test_ps_scale_refuses_bad_settings_before_it_calls_a_shard(setting, capsys):
    assert cli.main(["ps", "scale", "--addresses", "127.0.0.1:1", "--to", "127.0.0.1:1,127.0.0.1:2", *setting]) == 2
    assert "scale settings need wave_rows >= 1, 0 < copy_share <= 1" in capsys.readouterr().err


def test_bad_config_is_reported_without_starting(tmp_path, capsys):
    path = tmp_path / "ps.yaml"
    path.write_text("tables:\n  t: {dim: 0}\n")
    status = cli.main(["ps", "serve", "--port", "0", "--shard-index", "0", "--num-shards", "1", "--config", str(path)])
    assert status == 2
    assert "tables.t: table 't': dim must be in 1..65536" in capsys.readouterr().err


def test_top_level_usage(capsys):
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert "ps " in capsys.readouterr().out
    assert cli.main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "lightning-persia")
    result = subprocess.run([script, "ps", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and LISTENING_PREFIX in result.stdout


def test_idle_scheduling_refused_by_the_system_leaves_the_shard_serving_at_normal_priority(monkeypatch, caplog):
    from lightning_persia.remote_ps import process

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(process.os, "sched_setscheduler", refuse)
    with caplog.at_level("WARNING", logger="lightning_persia.ps"):
        process.schedule_idle()
    assert "scheduling 'idle' refused by the system" in caplog.text and "Operation not permitted" in caplog.text


def test_nice_lowers_the_shard_process_priority(start_ps_cluster):
    shards = start_ps_cluster(1, overrides=["nice=5"])
    assert os.getpriority(os.PRIO_PROCESS, shards.processes[0].pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)
