"""The `meshd` command line: run the daemon, inspect the mesh, manage membership.

    meshd run [--peer HOST:PORT] [--memory-budget 12GB] ...   the daemon (foreground)
    meshd status | peers [--json] [--watch]                  the mesh as this daemon sees it
    meshd token                                              print a join token for this mesh
    meshd join TOKEN                                         make this machine's daemon join a mesh
    meshd plan [--mesh FILE] [--model DIR] ...               plan a model over the mesh
    meshd profile [--remeasure]                              this machine's measured profile
    meshd demo [--nodes 3]                                   a small local mesh, shown, then stopped

Commands other than `run`, `profile` and `demo` talk to the local daemon over
its client API (a Unix socket in the state directory, or --api).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from meshd.config import ConfigError, add_setting_flags, flags_given, load_config, settings


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_setting_flags(parser, ("state_dir", "api"))


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, help="TOML config file (default: <state-dir>/meshd.toml)"
    )
    add_setting_flags(parser, [name for name in settings() if name not in ("state_dir", "api")])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshd", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run the daemon in the foreground",
        description="Run the daemon. Every setting is also read from the config file (the "
        "same name) and the environment (MESHD_<NAME>); flags win over both.",
    )
    _add_common(run)
    _add_run_flags(run)

    for name, text in (
        ("status", "the mesh as the local daemon sees it"),
        ("peers", "peers and links"),
    ):
        p = sub.add_parser(name, help=text)
        _add_common(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--watch", action="store_true", help="print again whenever the mesh changes")

    token = sub.add_parser("token", help="print a join token for this daemon's mesh")
    _add_common(token)

    join = sub.add_parser("join", help="give this machine the secret of an existing mesh")
    _add_common(join)
    join.add_argument("token", help="the token printed by `meshd token` on a member")

    profile = sub.add_parser("profile", help="measure (or show the cached) profile of this machine")
    _add_common(profile)
    profile.add_argument(
        "--remeasure",
        action="store_true",
        help="measure again (the running daemon does, and publishes it; else this command)",
    )
    add_setting_flags(profile, ("memory_budget", "device"))
    profile.add_argument("--json", action="store_true")

    plan = sub.add_parser("plan", help="plan a model over the mesh (live view or --mesh FILE)")
    _add_common(plan)
    from meshd.api.plan_cli import add_plan_arguments

    add_plan_arguments(plan)

    generate = sub.add_parser("generate", help="stream a completion from the mesh")
    _add_common(generate)
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument("--raw", action="store_true", help="no chat template around the prompt")
    _add_sampling(generate)

    chat = sub.add_parser("chat", help="chat with the mesh's model in the terminal")
    _add_common(chat)
    chat.add_argument("--system", help="a system message")
    _add_sampling(chat)

    models = sub.add_parser("models", help="models in this node's store, and the mesh's model")
    _add_common(models)
    models.add_argument("--json", action="store_true")
    models.add_argument("action", nargs="?", choices=["rm"], help="rm NAME: free its space")
    models.add_argument("name", nargs="?", help="a store name or ORG/NAME[@REVISION]")

    load = sub.add_parser("load", help="select the model the mesh runs")
    _add_common(load)
    load.add_argument(
        "model", help="a store name, a model directory, a .gguf file or ORG/NAME[@REVISION]"
    )
    load.add_argument("--strategy", choices=["speed", "memory"])
    load.add_argument("--context-length", type=int)
    load.add_argument("--concurrency", type=int)
    load.add_argument(
        "--parallelism",
        choices=["auto", "pipeline", "tensor", "hybrid"],
        help="kind of layout (default: the daemon's setting, auto)",
    )
    load.add_argument(
        "--no-wait",
        action="store_true",
        help="for ORG/NAME: return at once instead of showing each node's download",
    )

    from meshd.http.keys_cli import register as register_api_key

    register_api_key(sub)

    demo = sub.add_parser("demo", help="start a small local mesh on loopback, show it, stop it")
    demo.add_argument("--nodes", type=int, default=3, help="number of local daemons (default 3)")
    demo.add_argument("--keep-state", type=Path, help="keep the daemons' state here")
    demo.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds")
    from meshd.api.doctor import register as register_doctor
    from meshd.app.cli import register as register_app
    from meshd.service.cli import register as register_service

    register_service(sub)  # `meshd service ...`; each sets its own `handler`
    register_app(sub)  # `meshd app`
    register_doctor(sub)  # `meshd doctor`
    from meshd.api.hub_cli import register as register_pull

    register_pull(sub)  # `meshd pull`
    return parser


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, help="0 = greedy (default)")
    group.add_argument("--top-p", type=float)
    group.add_argument("--top-k", type=int)
    group.add_argument("--min-p", type=float)
    group.add_argument("--repetition-penalty", type=float)
    group.add_argument("--seed", type=int, help="same seed, same output")
    group.add_argument(
        "--max-tokens", type=int, help="at most this many tokens (default 256, or what fits)"
    )
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--model", help="fail unless the mesh runs this model")
    group.add_argument("--plan", dest="plan_id", help="run on exactly this committed plan id")


def _sampling(args: argparse.Namespace):
    from meshd.wire import pb

    sampling = pb.Sampling(stop=args.stop)
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_tokens")
    for name in names:
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    return sampling


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("zeroconf", "asyncio", "grpc"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_run(args: argparse.Namespace) -> NoReturn:
    import trio

    from meshd.mesh.membership import DuplicateNodeId
    from meshd.node import run_node
    from meshd.runtime import hoptrace
    from meshd.runtime.import_tables import IMPORT_TABLES_FOLDER, keep_transformers_import_table
    from meshd.runtime.thread_names import name_this_thread
    from meshd.state_lock import StateDirInUse

    config = load_config(flags_given(args), config_path=args.config)
    _setup_logging(config.log_level)
    hoptrace.start_from_env()  # off unless MESHD_HOP_TRACE names a directory
    # Before a model's first load imports transformers (and before its runners start).
    keep_transformers_import_table(config.model_store / IMPORT_TABLES_FOLDER)

    async def main() -> None:
        leave: list = []  # the node's graceful leave, once it has started
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope, leave)
            info = await nursery.start(run_node, config)
            if info.leave is not None:
                leave.append(info.leave)

    exit_code = 0
    name_this_thread("meshd")  # `ps` and `top` show the daemon as meshd, not python
    try:
        trio.run(main)
    except* (DuplicateNodeId, StateDirInUse) as group:  # exit 3: a restart cannot fix it
        for exc in _leaves(group):
            print(f"meshd: {exc}", file=sys.stderr)
        exit_code = 3
    except* ConfigError as group:  # e.g. the HTTP address is taken or needs an API key
        for exc in _leaves(group):
            print(f"meshd: {exc}", file=sys.stderr)
        exit_code = 2
    except* KeyboardInterrupt:
        pass
    finally:
        hoptrace.stop()
    _end_process(exit_code)


def _end_process(exit_code: int) -> NoReturn:
    """End `meshd run` once the node has stopped, without the interpreter's teardown.

    The node has closed its servers, left the mesh and joined its compute thread by now. What
    is left are threads meshd does not own (MLX's streams of worker threads that loaded or
    measured, OpenBLAS, gRPC core) whose thread-local destructors race the interpreter's
    finalization: 1 stop in about 15 of a whole mesh at once ended in SIGABRT ("terminate
    called without an active exception", MLX's teardown taking the GIL from a finalizing
    interpreter). So the output is flushed and the process exits at once, with its status.
    """
    if "mlx.core" in sys.modules:
        import mlx.core as mx

        mx.clear_streams()  # this thread's: as MLX asks of every thread that used it
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(exit_code)


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions inside (possibly nested) exception groups."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


async def _stop_on_signal(scope, leave: list) -> None:
    """SIGTERM (a service stop or restart): leave the mesh gracefully, bounded by
    ``leave_grace_s`` (requests move or finish), then stop. SIGINT (Ctrl-C), a SIGTERM while
    the node is still starting, or a second signal while leaving: stop now."""
    import trio

    log = logging.getLogger("meshd")
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum != signal.SIGTERM or not leave:
                log.info("received %s, shutting down", name)
                scope.cancel()
                return
            log.info("received %s, leaving the mesh (send it again to stop at once)", name)
            async with trio.open_nursery() as leaving:

                async def leave_then_stop() -> None:
                    await leave[0]()
                    scope.cancel()

                leaving.start_soon(leave_then_stop)
                async for again in signals:
                    log.info("received %s while leaving: stopping now", signal.Signals(again).name)
                    scope.cancel()
                    return


def _state_dir(args: argparse.Namespace) -> Path:
    config = load_config({"state_dir": args.state_dir} if args.state_dir else {})
    return config.state_dir


def _api(args: argparse.Namespace) -> str:
    from meshd.api.client import api_address_for

    if args.api:
        return args.api
    return api_address_for(_state_dir(args), None)


def cmd_status(args: argparse.Namespace) -> int:
    from meshd.api import client, render

    api = _api(args)
    statuses = client.watch_status(api) if args.watch else iter([client.fetch_status(api)])
    for status in statuses:
        if args.json:
            print(json.dumps(render.status_to_json(status), indent=None if args.watch else 2))
        elif args.command == "peers":
            print(render.peers_table(status))
        else:
            print(render.status_text(status))
        sys.stdout.flush()
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    from meshd.api import client
    from meshd.mesh import security

    try:
        print(client.fetch_token(_api(args)).token)
    except client.DaemonUnreachable:
        secret = security.load_secret(_state_dir(args))
        if secret is None:
            print(
                "meshd: this machine has no mesh yet; start the daemon (`meshd run`) to create one",
                file=sys.stderr,
            )
            return 1
        print(security.encode_join_token(secret))
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    from meshd.api import client
    from meshd.mesh import security

    secret = security.decode_join_token(args.token)
    state_dir = _state_dir(args)
    security.save_secret(state_dir, secret)
    print(f"this machine now belongs to mesh {secret.mesh_name!r} (state in {state_dir})")
    try:
        client.fetch_status(_api(args), timeout_s=1.0)
    except client.DaemonUnreachable:
        print("start the daemon with `meshd run` (or restart the service) to connect")
    else:
        print("a daemon is running with the old secret: restart it to join the new mesh")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """This machine's profile; ``--remeasure`` asks the running daemon to measure again (it
    then publishes the result to the mesh), or measures here when no daemon runs."""
    from meshd.api import client, render
    from meshd.mesh.profiling import cpu_model, load_or_measure_profile, profile_from_proto
    from meshd.runtime.device import DeviceUnavailable, select_device

    config = load_config(flags_given(args))
    profile = None
    if args.remeasure:
        try:
            status = client.remeasure(_api(args))
        except client.DaemonUnreachable:
            pass
        else:
            own = next(n.profile for n in status.nodes if n.source == "self")
            profile = profile_from_proto(own)
    if profile is None:
        try:  # measure on the device `meshd run` would compute on
            choice = select_device(config.device, cpu_name=cpu_model())
        except DeviceUnavailable as error:
            print(f"meshd profile: {error}", file=sys.stderr)
            return 2
        profile = load_or_measure_profile(
            _state_dir(args), memory_budget_override=config.memory_budget, remeasure=args.remeasure
        )
        profile = dataclasses.replace(profile, device_reason=choice.reason)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2))
    else:
        print(render.profile_text(profile))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from meshd.api.plan_cli import run_plan

    if not getattr(args, "mesh", None):
        args.api = _api(args)
    return run_plan(args)


def _print_stream(api: str, request) -> int:
    from meshd.api import client

    for event in client.stream_generation(api, request):
        if event.HasField("done"):
            done = event.done
            print(flush=True)  # end the generated text's line on stdout
            moved = f"; moved {done.resumes}x, paused {done.paused_s:.1f} s" if done.resumes else ""
            print(
                f"[{done.completion_tokens} tokens, {done.finish_reason}; first token "
                f"{done.ttft_s * 1e3:.0f} ms, {done.decode_tokens_per_s:.1f} tokens/s; "
                f"plan {done.plan_id[:12]}{moved}]",
                file=sys.stderr,
            )
        else:
            print(event.text, end="", flush=True)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from meshd.wire import pb

    request = pb.GenerateRequest(
        prompt=args.prompt,
        sampling=_sampling(args),
        model=args.model or "",
        plan_id=args.plan_id or "",
        chat_template=not args.raw,
    )
    return _print_stream(_api(args), request)


def cmd_chat(args: argparse.Namespace) -> int:
    from meshd.api import client
    from meshd.wire import pb

    api = _api(args)
    history: list[pb.ChatMessage] = []
    if args.system:
        history.append(pb.ChatMessage(role="system", content=args.system))
    print("chat with the mesh (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append(pb.ChatMessage(role="user", content=line))
        request = pb.ChatRequest(
            messages=history,
            sampling=_sampling(args),
            model=args.model or "",
            plan_id=args.plan_id or "",
        )
        answer = []
        for event in client.stream_generation(api, request):
            if event.HasField("text"):
                answer.append(event.text)
                print(event.text, end="", flush=True)
        print()
        history.append(pb.ChatMessage(role="assistant", content="".join(answer)))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from meshd.api import client, render

    if args.action == "rm":
        from meshd.api.hub_cli import cmd_models_rm

        if not args.name:
            raise ConfigError("meshd models rm needs a NAME (a store name or ORG/NAME)")
        return cmd_models_rm(args.name)
    models = client.list_models(_api(args))
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(models, preserving_proto_field_name=True), indent=2))
    else:
        print(render.models_table(models))
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from meshd.api import client
    from meshd.wire import pb

    reply = client.load_model(
        _api(args),
        pb.LoadModelRequest(
            model=args.model,
            strategy=args.strategy or "",
            context_length=args.context_length or 0,
            concurrency=args.concurrency or 0,
            parallelism=args.parallelism or "",
        ),
    )
    print(f"{reply.model} ({reply.digest}): {reply.message}")
    from meshd.api.hub_cli import follow_hub_load, names_repository

    if names_repository(args.model) and not args.no_wait:
        return follow_hub_load(_api(args), reply.model)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from meshd.api.demo import run_demo

    return run_demo(nodes=args.nodes, keep_state=args.keep_state, timeout_s=args.timeout)


COMMANDS = {
    "run": cmd_run,
    "status": cmd_status,
    "peers": cmd_status,
    "token": cmd_token,
    "join": cmd_join,
    "profile": cmd_profile,
    "plan": cmd_plan,
    "demo": cmd_demo,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "models": cmd_models,
    "load": cmd_load,
}


def main(argv: list[str] | None = None) -> int:
    from meshd.runtime.blas import enable_fast_blas

    enable_fast_blas()  # before any command imports mlx.core (see meshd.runtime.blas)
    # gRPC core's own INFO lines (e.g. a refused TLS handshake, without the peer's address)
    # would repeat what meshd says once, in words; GRPC_VERBOSITY set by the user wins.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    args = build_parser().parse_args(argv)
    from meshd.api.client import DaemonUnreachable, GenerationFailed
    from meshd.mesh.security import InvalidJoinToken

    try:
        return COMMANDS.get(args.command, getattr(args, "handler", None))(args)
    except (ConfigError, DaemonUnreachable, InvalidJoinToken, GenerationFailed) as exc:
        print(f"meshd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        missing = _mlx_backend_missing(exc)
        if missing is None:
            raise
        print(f"meshd: {MLX_BACKEND_HINT.format(error=missing)}", file=sys.stderr)
        return 2


MLX_BACKEND_HINT = (
    "MLX has no backend on this machine ({error}): install one with "
    "pip install 'meshd[cpu]' (or meshd[cuda12] / meshd[cuda13] for an NVIDIA GPU), or run "
    "packaging/install.sh, which picks it"
)


def _mlx_backend_missing(exc: BaseException) -> ImportError | None:
    """The ImportError of an MLX installed without its backend library (on Linux the backend is
    an extra of its own), wherever it surfaced: a command, or a task of the daemon's."""
    if isinstance(exc, BaseExceptionGroup):
        return next(filter(None, map(_mlx_backend_missing, exc.exceptions)), None)
    return exc if isinstance(exc, ImportError) and "libmlx" in str(exc) else None


if __name__ == "__main__":
    sys.exit(main())
