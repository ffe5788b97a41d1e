"""The ``lightning-persia`` console entry.

    lightning-persia fit --config examples/dlrm/config.yaml [--trainer.strategy.init_args.staleness=8 ...]
    lightning-persia validate|test|predict --config ... [--ckpt_path ...]
    lightning-persia ps serve --port 5000 --shard-index 0 --num-shards 2 [--metrics-port 9100] [--config ps.yaml] [key=value ...]
    lightning-persia export --ckpt CKPT [--config CONFIG] --out BUNDLE
    lightning-persia serve BUNDLE [--port 8000] [--ps-addresses host:port ...] [--deltas DIR [--version V]]

The training commands are LightningCLI's, with ``strategy: persia`` available. ``ps`` runs parameter-server
processes and never imports Lightning. Every command is one entry of :data:`COMMANDS`.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import logging
import os
import re
import sys
import textwrap
from typing import Callable, Optional, Sequence


def _ps_parser() -> argparse.ArgumentParser:
    from lightning_persia.remote_ps.protocol import AUTH_METADATA_KEY, LISTENING_PREFIX, TOKEN_ENV
    from lightning_persia.remote_ps.client.scaling import ScaleSettings

    parser = argparse.ArgumentParser(prog="lightning-persia ps", description="Parameter-server shards.")
    sub = parser.add_subparsers(dest="ps_command", required=True, metavar="{serve,scale}")
    serve = sub.add_parser(
        "serve",
        help="serve one shard of the parameter server",
        description="Serve one parameter-server shard over gRPC until SIGTERM. With --port 0 a free port is "
        f"picked; the bound address is printed as '{LISTENING_PREFIX} host:port' on a line of its own.",
    )
    serve.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one")
    serve.add_argument("--shard-index", type=int, required=True, help="index of this shard, in [0, num-shards)")
    serve.add_argument("--num-shards", type=int, required=True, help="number of shards of the cluster")
    serve.add_argument("--join", action="store_true",
                       help="a shard whose --shard-index is at or past --num-shards joins a running cluster: it holds "
                       "nothing until `ps scale` moves slots to it (a StatefulSet scaled up starts its new pods so)")
    serve.add_argument("--config", help="PS YAML config (seed, limits, table defaults); OmegaConf syntax")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1); any non-loopback address needs --token, TLS or --insecure")
    serve.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                       help=f"shared secret every call must carry as '{AUTH_METADATA_KEY}: Bearer TOKEN' "
                       f"(default: ${TOKEN_ENV}); without TLS it crosses the network in the clear")
    serve.add_argument("--tls-cert", help="PEM certificate chain of this shard (enables TLS, with --tls-key)")
    serve.add_argument("--tls-key", help="PEM private key of this shard")
    serve.add_argument("--tls-client-ca", help="PEM CA bundle; clients must then present a certificate it signed")
    serve.add_argument("--insecure", action="store_true",
                       help="allow a non-loopback address without token or TLS (anyone who reaches it can read and write tables)")
    serve.add_argument("--parent-pid", type=int,
                       help="exit when this process is gone (set by launchers that own the shard). When it is the "
                       "direct parent, the shard also asks Linux for SIGTERM at the parent's death, which fires when "
                       "the parent *thread* that started the shard exits: start shards from a thread that outlives them")
    serve.add_argument("--restore-from", metavar="DIR",
                       help="load a checkpoint before serving: a checkpoint folder, a folder holding several (the "
                       "newest complete one is used), or a serving bundle (its tables, with its seed). The shard "
                       "refuses to start if none loads (config: restore_from)")
    serve.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="also serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port; config: "
                       "metrics_port); the shard refuses to start if the port is taken")
    serve.add_argument("--read-only", action="store_true",
                       help="an inference shard: lookups only (nothing is inserted); updates, loads, saves and table "
                       "changes are refused (config: read_only)")
    serve.add_argument("--watch-deltas", metavar="DIR",
                       help="with --read-only --restore-from BUNDLE: apply the versioned deltas published under DIR "
                       "(PublishDeltas) on its own, in order, as they appear, for clients that no serving endpoint "
                       "drives. Each table switches at once, but the shards of a cluster each at their own moment")
    serve.add_argument("--version", type=int, metavar="V",
                       help="with --watch-deltas: apply the deltas up to version V only (a rollback); the shard refuses "
                       "to start if it cannot reach V")
    serve.add_argument("--watch-interval", type=float, default=1.0, metavar="S",
                       help="with --watch-deltas: seconds between two looks for a new version (default 1)")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="config overrides in OmegaConf dotlist form, e.g. seed=7 tables.user.dim=32")
    scale = sub.add_parser(
        "scale",
        help="add or drain shards of a running cluster; rows move live",
        description="Move a running cluster onto more or fewer shards while it serves (docs/elastic.md). Start the "
        "new shards first (ps serve --shard-index i --num-shards M); drained ones are the last and can be stopped "
        "once this command returns.",
    )
    scale.add_argument("--addresses", required=True, help="host:port of the cluster's shards now, comma-separated, in order")
    scale.add_argument("--to", required=True, help="host:port of the shards after the move, comma-separated: the "
                       "current ones in order, then the new ones (growing), or the first M of them (draining the rest)")
    scale.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"the shards' token (default: ${TOKEN_ENV})")
    scale.add_argument("--tls-root-cert", help="PEM CA of the shards' certificates (enables TLS)")
    for setting in dataclasses.fields(ScaleSettings):  # the move's pacing (docs/elastic.md, *What it costs*)
        scale.add_argument(f"--{setting.name.replace('_', '-')}", type=type(setting.default), default=setting.default,
                           help=f"ScaleSettings.{setting.name} (default: %(default)s)")
    scale.add_argument("--json", action="store_true", help="print the move's report as one JSON object on the last line")
    scale.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def _ps_main(argv: Sequence[str]) -> int:
    parser = _ps_parser()
    args = parser.parse_args(argv)
    if args.ps_command == "scale":
        return _ps_scale(args)
    if args.join and args.shard_index >= args.num_shards >= 1:
        args.num_shards = args.shard_index + 1  # the map it starts with is nobody's: the move gives it the cluster's
    if not 0 <= args.shard_index < args.num_shards:
        parser.error(f"--shard-index must be in [0, --num-shards={args.num_shards}), got {args.shard_index} (a shard "
                     "joining a running cluster: --join)")
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    if args.watch_deltas and not (args.read_only and args.restore_from):
        parser.error("--watch-deltas needs --read-only and --restore-from BUNDLE (the version the deltas start from)")
    if args.version is not None and not args.watch_deltas:
        parser.error("--version needs --watch-deltas")
    if args.watch_interval <= 0:
        parser.error(f"--watch-interval must be > 0, got {args.watch_interval}")
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format=f"%(asctime)s persia-ps[{args.shard_index}/{args.num_shards}] %(levelname)s %(message)s",
    )

    from lightning_persia.remote_ps.security import BindSecurityError, TLSFiles
    from lightning_persia.remote_ps.server import Endpoint, run_shard
    from lightning_persia.remote_ps.config import load_ps_config
    from lightning_persia.remote_ps.store import CheckpointError
    from lightning_persia.remote_ps.table_config import ConfigError
    from lightning_persia.serving.bundle import Bundle, BundleError, is_bundle

    tls = TLSFiles(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    model_version = 0
    try:
        config = load_ps_config(args.config, args.overrides)
        if args.restore_from:
            config.restore_from = os.path.abspath(args.restore_from)
        if args.metrics_port is not None:
            config = dataclasses.replace(config, metrics_port=args.metrics_port)  # validated like the YAML value
        if args.read_only:
            config.read_only = True
        if config.restore_from and is_bundle(config.restore_from):
            bundle = Bundle.open(config.restore_from)
            bundle.verify(bundle.table_manifests())  # the shard checks each table file against these manifests
            config.restore_from, config.seed = str(bundle.tables_path), bundle.ps_seed
            model_version = bundle.version
            logging.info("restoring the tables of bundle %s (version %d, seed %d)", bundle.path, bundle.version, bundle.ps_seed)
        elif args.watch_deltas:
            parser.error(f"--watch-deltas needs --restore-from a serving bundle; {args.restore_from} is not one")
        watch = None
        if args.watch_deltas:
            watch = functools.partial(_watch_deltas, root=os.path.abspath(args.watch_deltas), up_to=args.version,
                                      interval_s=args.watch_interval, name=f"shard {args.shard_index}/{args.num_shards}")
        return run_shard(
            shard_index=args.shard_index, num_shards=args.num_shards, config=config,
            endpoint=Endpoint(host=args.host, port=args.port, token=args.token, tls=tls, insecure=args.insecure),
            parent_pid=args.parent_pid, model_version=model_version, before_serving=watch,
        )
    except (CheckpointError, BundleError) as err:
        print(f"lightning-persia ps serve: error: cannot restore: {err}", file=sys.stderr, flush=True)
        return 2
    except (BindSecurityError, ConfigError, OSError) as err:
        print(f"lightning-persia ps serve: error: {err}", file=sys.stderr, flush=True)
        return 2


def _watch_deltas(servicer, stop, *, root: str, up_to: Optional[int], interval_s: float, name: str) -> None:
    """A shard's own delta watcher: the versions published so far before the shard serves, the next ones as they come."""
    from lightning_persia.serving.delta import DeltaWatcher

    served = servicer.served
    servicer.watching_deltas = root
    watcher = DeltaWatcher(root, lambda: served.version,
                           lambda delta: served.apply(str(delta.tables_path), delta.version, delta.base_version),
                           up_to=up_to, interval_s=interval_s, name=name)
    watcher.catch_up(strict=up_to is not None)  # a rollback that cannot reach its version: the shard does not start
    if up_to is None:
        watcher.start(stop)


def _export_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-persia export",
        description="Write the serving bundle of a PersiaStrategy checkpoint: dense weights (safetensors), the module "
        "to rebuild, the tables (hard links or copies of the checkpoint's parameter-server files) and a manifest with "
        "a version and the checksum of every file. The bundle can be copied to another machine.",
    )
    parser.add_argument("--ckpt", required=True, help="the .ckpt file (its tables are in CKPT.ps/ beside it)")
    parser.add_argument("--out", required=True, help="the bundle's folder (must not exist)")
    parser.add_argument("--config", help="the LightningCLI config of the training run (its model section rebuilds the "
                        "module); default: the hyper-parameters saved in the checkpoint")
    parser.add_argument("--model-class", help="class path of the LightningModule, for checkpoints not made with "
                        "LightningCLI and exported without --config (e.g. examples.dlrm.model.DLRM)")
    parser.add_argument("--version", type=int, default=1, help="model version the bundle's answers carry (default 1)")
    parser.add_argument("--ps-seed", type=int, help="seed of the shards that trained the tables (default: the "
                        "strategy's ps.seed recorded in the checkpoint)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, help="a progress bar of the bytes copied "
                        "and checksummed, on stderr (default: when stderr is a terminal)")
    args = parser.parse_args(argv)
    _import_from_working_directory()
    from lightning_persia.serving import BundleError, export_bundle

    try:
        bundle = export_bundle(args.ckpt, args.out, config=args.config, model_class=args.model_class, version=args.version,
                               ps_seed=args.ps_seed, progress=sys.stderr.isatty() if args.progress is None else args.progress)
    except BundleError as err:
        print(f"lightning-persia export: error: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"exported {bundle.module_class_path} version {bundle.version} ({bundle.num_shards}-shard tables) to {bundle.path}")
    return 0


def _serve_main(argv: Sequence[str]) -> int:
    from lightning_persia.remote_ps.protocol import TOKEN_ENV

    parser = argparse.ArgumentParser(
        prog="lightning-persia serve",
        description="Serve a bundle over HTTP (LitServe): POST /predict with {\"sparse\": {\"<feature>\": [ids, ...]}, "
        "\"dense\": [floats, ...]} answers {\"score\": float, \"version\": int}; GET /health. Without --ps-addresses "
        "the tables are served by read-only shards started here.",
    )
    parser.add_argument("bundle", help="the bundle's folder (lightning-persia export)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1", "0.0.0.0", "::"],
                        help="address to bind (default 127.0.0.1)")
    parser.add_argument("--ps-addresses", nargs="+", metavar="HOST:PORT",
                        help="inference shards serving this bundle (lightning-persia ps serve --read-only --restore-from BUNDLE), in shard order")
    parser.add_argument("--num-shards", type=int, help="shards to start when no --ps-addresses are given (default: as many as trained the tables)")
    parser.add_argument("--wire-dtype", choices=["fp16", "fp32"], help="rows on the wire (default: the training strategy's)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="requests run through the model together (default 32)")
    parser.add_argument("--batch-timeout", type=float, default=0.002, help="seconds a batch waits to fill (default 0.002)")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads of the inference worker (default 1; 0: torch's default)")
    parser.add_argument("--decoder", metavar="MODULE.CALLABLE",
                        help="f(predictor) -> RequestDecoder for this model's requests (default: CriteoRequestDecoder)")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"token of the shards (default: ${TOKEN_ENV})")
    parser.add_argument("--deltas", metavar="DIR",
                        help="apply the versioned deltas published under DIR (PublishDeltas), in order: those there now "
                        "before serving, then each new one between two batches; a refused delta is logged and the last "
                        "good version keeps serving")
    parser.add_argument("--version", type=int, metavar="V",
                        help="with --deltas: serve version V (the bundle plus the deltas up to V: a rollback) and no later one")
    parser.add_argument("--watch-interval", type=float, default=1.0, metavar="S",
                        help="with --deltas: seconds between two looks for a new version (default 1)")
    args = parser.parse_args(argv)
    if args.num_shards is not None and args.num_shards < 1:
        parser.error(f"--num-shards must be >= 1, got {args.num_shards}")
    if args.max_batch_size < 1 or args.batch_timeout < 0 or args.torch_threads < 0:
        parser.error("--max-batch-size must be >= 1, --batch-timeout and --torch-threads >= 0")
    if args.version is not None and not args.deltas:
        parser.error("--version needs --deltas (the bundle is one version; the deltas make the later ones)")
    if args.watch_interval <= 0:
        parser.error(f"--watch-interval must be > 0, got {args.watch_interval}")
    _import_from_working_directory()
    from lightning_persia.serving import BundleError, serve

    predictor_options = {"num_shards": args.num_shards, "wire_dtype": args.wire_dtype, "token": args.token,
                         "deltas": os.path.abspath(args.deltas) if args.deltas else None, "version": args.version,
                         "watch_interval_s": args.watch_interval}
    options: dict = {"max_batch_size": args.max_batch_size, "batch_timeout": args.batch_timeout, "ps_addresses": args.ps_addresses,
                     "torch_threads": args.torch_threads, "log_level": "INFO",
                     "predictor_options": {k: v for k, v in predictor_options.items() if v is not None}}
    if args.decoder:
        module_name, _, name = args.decoder.rpartition(".")
        try:
            options["decoder"] = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError) as err:
            parser.error(f"cannot import --decoder {args.decoder!r}: {err}")
    try:
        serve(args.bundle, port=args.port, host=args.host, **options)
    except (BundleError, ValueError, RuntimeError) as err:
        print(f"lightning-persia serve: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


def _import_from_working_directory() -> None:
    """Lets configs and bundles name classes of the working directory (``examples.dlrm.model.DLRM``), as ``python -m`` sees them."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


class ConfigurationError(ValueError):
    """A class of the configuration refused its arguments (the message is its reason)."""


def lightning_cli(args: Sequence[str]):
    """Runs LightningCLI on ``args`` (``["fit", "--config", ...]``) with ``strategy: persia`` available.

    Configs may name classes of the working directory (``examples.dlrm.model.DLRM``), as ``python -m`` sees them.
    A class that refuses its arguments (``staleness=-1``) raises :class:`ConfigurationError` with its reason; an
    old flat strategy argument (``ps_token``) is refused by the parser naming its new place (``ps.token``).
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from lightning.pytorch.cli import LightningCLI

    import lightning_persia  # noqa: F401  (registers strategy="persia")
    from lightning_persia.strategy.cli_parser import PersiaArgumentParser

    class _CLI(LightningCLI):
        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except ValueError as error:
                raise ConfigurationError(_refusal(str(error))) from error

    # LightningCLI warns when it is given arguments while the process has a command line of its own; from the
    # console entry they are that command line.
    own_command_line = list(args) == sys.argv[1:]
    return _CLI(args=None if own_command_line else list(args), save_config_kwargs={"overwrite": True}, parser_class=PersiaArgumentParser)


def _refusal(message: str) -> str:
    """The reason inside jsonargparse's report of a value no member of its Union type accepts.

    ``trainer.strategy`` (``str | Strategy``), ``model`` and ``data`` (``Optional[...]``) are Unions: the report
    lists every member's error ("Expected a <class 'str'>" for the members the value is not, the class's own
    ``ValueError`` for the one it is) and then the whole value, which is long. The reason is the class's error.
    """
    if "\nErrors:\n" not in message:
        return message
    errors = message.split("\nErrors:\n", 1)[1].split("\nGiven value type:", 1)[0]
    items = [_unindent(item) for item in ("\n" + errors).split("\n  - ")[1:]]
    reasons = [_refusal(item) for item in items if not item.startswith("Expected a ")]  # a member may be a Union too
    class_path = re.search(r"\nGiven value: Namespace\(class_path='([^']+)'", message)
    where = f"{class_path.group(1)}: " if class_path else ""
    return where + "; ".join(reasons) if reasons else message


def _unindent(item: str) -> str:
    """A list item whose continuation lines are indented (jsonargparse's layout) as a text of its own."""
    first, _, rest = item.partition("\n")
    return f"{first}\n{textwrap.dedent(rest)}".strip()


def _lightning_command(command: str) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        try:
            lightning_cli([command, *argv])
        except ConfigurationError as error:
            print(f"lightning-persia {command}: error: {error}", file=sys.stderr, flush=True)
            return 2
        return 0

    return run


# name -> (one-line help, handler of the remaining arguments)
COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    **{name: (f"LightningCLI {name} (--config YAML, any --trainer/--model/--data flag)", _lightning_command(name)) for name in ("fit", "validate", "test", "predict")},
    "ps": ("parameter-server shards (ps serve ...)", _ps_main),
    "export": ("write the serving bundle of a checkpoint (export --ckpt CKPT --out DIR)", _export_main),
    "serve": ("serve a bundle over HTTP (serve BUNDLE --port P)", _serve_main),
}


def _ps_scale(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s persia-ps-scale %(levelname)s %(message)s")
    from lightning_persia.remote_ps.client import PSClient, PSError, RetryPolicy
    from lightning_persia.remote_ps.client.scaling import ScaleSettings, rescale, wait_drained

    current, target = _addresses(args.addresses), _addresses(args.to)
    try:
        settings = ScaleSettings(**{setting.name: getattr(args, setting.name) for setting in dataclasses.fields(ScaleSettings)})
    except ValueError as err:
        print(f"lightning-persia ps scale: error: {err}", file=sys.stderr, flush=True)
        return 2
    # a shard killed during the move is restarted by its supervisor and replays its log: the move's calls wait for
    # it (a taker's restart then costs the move nothing) rather than give the move up after a few seconds
    retry = RetryPolicy(retry_for_s=60)
    try:
        with PSClient(current, token=args.token, tls_root_cert=args.tls_root_cert, retry=retry) as admin:
            admin.wait_healthy(60)
            report = rescale(admin, target, settings)
            if len(target) < len(current):
                wait_drained(admin, list(range(len(target), len(current))))
    except PSError as err:
        print(f"lightning-persia ps scale: error: {err}", file=sys.stderr, flush=True)
        return 1
    drained = f"; stop shards {', '.join(current[len(target):])}" if len(target) < len(current) else ""
    print(f"{report.from_shards} -> {report.to_shards} shards (shard map version {report.map_version}): "
          f"{report.slots_moved} slots, {report.rows_moved} rows moved in {report.seconds:.1f} s{drained}", flush=True)
    if args.json:
        print(json.dumps(dataclasses.asdict(report)), flush=True)
    return 0


def _addresses(text: str) -> list[str]:
    return [address.strip() for address in text.split(",") if address.strip()]


def _usage() -> str:
    lines = ["usage: lightning-persia COMMAND ...", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (text, _) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    entry = COMMANDS.get(argv[0])
    if entry is None:
        print(f"{_usage()}\n\nlightning-persia: error: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    return entry[1](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
