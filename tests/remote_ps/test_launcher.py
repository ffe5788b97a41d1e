"""The command line of a shard process, built in one place for first starts and restarts alike."""
import sys

from lightning_persia.remote_ps.launcher import serve_command


def test_a_first_start_binds_a_free_port_and_carries_the_callers_options_in_order():
    command = serve_command(1, 3, parent_pid=42, config_path="ps.yaml", extra_args=["--read-only"], overrides=["seed=7"])
    assert command == [sys.executable, "-m", "lightning_persia.cli", "ps", "serve", "--port", "0", "--host", "127.0.0.1",
                       "--shard-index", "1", "--num-shards", "3", "--parent-pid", "42", "--read-only", "--config", "ps.yaml",
                       "seed=7"]


def test_a_restart_keeps_its_port_and_restores_before_the_callers_arguments_can_override_them():
    command = serve_command(0, 1, port=5123, restore_from="/ckpt", extra_args=["--port", "6000"])
    assert command[command.index("--restore-from") + 1] == "/ckpt"
    ports = [command[i + 1] for i, arg in enumerate(command) if arg == "--port"]
    assert ports == ["5123", "6000"]  # argparse keeps the last: a caller's --port wins
    assert "--parent-pid" not in command
