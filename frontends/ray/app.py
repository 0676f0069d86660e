"""spekula on Ray Serve: one HTTP ingress and N engine replica deployments.

    spekula serve --ray --replicas 2 -m model.gguf -np 4 --port 8000
    serve run spekula.frontends.ray.app:app model=model.gguf parallel=4 replicas=2

The ingress runs the same Starlette application as `spekula serve --port` over a RoutedEngine
(frontends/ray/engine.py), which sends each request to the replica whose slots hold the longest
prefix of its prompt (frontends/ray/router.py). Each replica deployment `engine-<i>` is one
spekula engine (frontends/ray/replica.py) with its own slots, threads and device; Ray restarts a
replica that dies or fails its health check. Only this module and the two it names import Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
import socket
import sys
import threading
from functools import partial
from typing import Any

import anyio
import ray
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from spekula.core.errors import ConfigError
from spekula.frontends.cli.main import normalize_option_names
from spekula.frontends.cli.serve_options import http_state, serve_parser, server_defaults
from spekula.frontends.http.server import bind
from spekula.frontends.ray.replica import EngineReplica

APP_NAME = "spekula"
DEFAULT_PORT = 8000  # Ray Serve's own default HTTP port
# For a cluster this command starts itself: Serve's control loop and metrics export run 10 times a
# second in every Serve actor by default, CPU taken from the engines on a small machine. Slower
# here (a failed replica is noticed within half a second either way: its calls fail at once).
# Serve's direct ingress, too: the ingress replica answers HTTP on the user's port itself, instead of
# behind Serve's HTTP proxy actor, which took a second hop and about 7 ms of CPU per request under
# load (bench/RESULTS.md). Its port quarantine and minimum drain exist for an external load
# balancer (HAProxy) that is not used here; without them a restarted ingress gets its port back at
# once and a stop does not wait 30 s on an idle ingress.
# Set in the environment to override; a cluster started with `ray start` keeps its own settings.
LOCAL_CLUSTER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
                     "RAY_USAGE_STATS_ENABLED": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                     "RAY_SERVE_PORT_QUARANTINE_S": "0", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


class SpekulaIngress:
    """The HTTP API in front of the replicas (late-bound ASGI app: it is built once replica 0
    has described its engine, so the ingress reports the replicas' real settings)."""

    def __init__(self, args: argparse.Namespace, *replicas: DeploymentHandle) -> None:
        self.args = args
        self.replicas = list(replicas)
        self._watch: asyncio.Task[None] | None = None

    async def __serve_build_asgi_app__(self) -> Any:
        from spekula.core.modelfile.gguf_file import GGUFFile
        from spekula.frontends.cli.options import resolve_model_path, target_tokenizer
        from spekula.frontends.http.app import build_app
        from spekula.frontends.http.generation import GenerationService
        from spekula.frontends.http.metrics import render as render_metrics
        from spekula.frontends.ray.engine import RoutedEngine

        args = self.args
        described = await self.replicas[0].describe.remote()
        tokenizer = await anyio.to_thread.run_sync(
            lambda: target_tokenizer(args, GGUFFile.shared(resolve_model_path(args))))
        engine = RoutedEngine(self.replicas, described, tokenizer)
        await engine.refresh()
        state = http_state(args)
        state.attach(engine, GenerationService(engine, server_defaults(args), state.write_timeout))
        state.metrics_render = partial(render_metrics, engine)
        state.refresh = engine.refresh
        state.server_header = False
        self._watch = asyncio.get_running_loop().create_task(engine.watch())
        return build_app(state)


def threads_per_replica(args: argparse.Namespace) -> int:
    """-t, or this machine's cores shared out between the replicas (they would fight otherwise)."""
    if args.threads and args.threads > 0:
        return int(args.threads)
    return max(1, (os.cpu_count() or 1) // args.replicas)


def serve_logging(args: argparse.Namespace) -> dict[str, Any]:
    """Ray Serve's logs: a line per request and per call in every actor unless -v (each costs CPU
    the engines would otherwise have; spekula's own warnings still go out)."""
    return {"log_level": "INFO" if args.verbose else "WARNING", "enable_access_log": bool(args.verbose)}


def application(args: argparse.Namespace) -> Application:
    args = argparse.Namespace(**vars(args))
    args.threads = threads_per_replica(args)
    replica = serve.deployment(EngineReplica)
    engines = [
        replica.options(
            name=f"engine-{i}", num_replicas=1,
            # A CUDA replica gets one GPU of its own from Ray (which sets CUDA_VISIBLE_DEVICES for it).
            ray_actor_options={"num_cpus": args.threads, "num_gpus": 1 if str(args.device).startswith("cuda") else 0},
            # Requests queue in the engine (it schedules its slots), not in Ray.
            max_ongoing_requests=max(64, 16 * args.parallel),
            health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=args.drain_timeout,
            logging_config=serve_logging(args),
        ).bind(args, i)
        for i in range(args.replicas)
    ]
    ingress = serve.deployment(serve.ingress()(SpekulaIngress)).options(
        name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000,
        graceful_shutdown_timeout_s=args.drain_timeout, logging_config=serve_logging(args))
    return ingress.bind(args, *engines)


def app(config: dict[str, str]) -> Application:
    """Application builder for `serve run spekula.frontends.ray.app:app key=value ...` (or a Serve
    config file's `args:`). Each key is a `spekula serve` option without its dashes (`model`,
    `parallel`, `spec-type`, `replicas`, ...); a flag is on with `true`. `argv` takes a whole
    command line instead."""
    parser = serve_parser()
    flags = {opt: action for action in parser._actions for opt in action.option_strings}
    argv = shlex.split(config.get("argv", ""))
    for key, value in config.items():
        if key == "argv":
            continue
        opt = "--" + key.replace("_", "-")
        action = flags.get(opt) or flags.get("-" + key)
        if action is None:
            raise ConfigError(f"unknown spekula serve option in the Serve application's args: {key!r}")
        if action.nargs == 0:
            if str(value).lower() in ("1", "true", "yes", "on"):
                argv.append(opt)
        else:
            argv += [opt, str(value)]
    return application(parser.parse_args(normalize_option_names(argv)))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_on_ray(args: argparse.Namespace) -> int:
    """`spekula serve --ray`: deploy, print the address, serve until SIGINT/SIGTERM, clean up."""
    from spekula.frontends.cli.options import preflight

    preflight(args)  # a bad model file or option is one clear error, before any replica tries it
    port = DEFAULT_PORT if args.port is None else args.port or _free_port(args.host)
    threads = threads_per_replica(args)
    quiet = ray.LoggingConfig(log_level="WARNING")
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    proxy_port = port  # where Serve's HTTP proxy listens
    if args.ray_address:
        # The cluster's own Serve settings decide whether its ingress answers directly or behind
        # the proxy; the proxy listens on the port either way.
        ray.init(address=args.ray_address, log_to_driver=args.verbose, logging_config=quiet)
    else:
        if local_cluster_env(args.host, port):
            proxy_port = _free_port(args.host)  # Serve still starts its proxy: give it a port of its own
        ray.init(num_cpus=max(os.cpu_count() or 1, threads * args.replicas), include_dashboard=False,
                 log_to_driver=args.verbose, logging_config=quiet)
    try:
        serve.start(http_options={"host": args.host, "port": proxy_port}, logging_config=serve_logging(args))
        try:
            serve.run(application(args), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as exc:
            raise ConfigError(f"the Ray Serve application did not start: {_last_line(exc)}") from None
        print(f"spekula: HTTP server listening on http://{args.host}:{port} "
              f"(Ray Serve, {args.replicas} replica(s), {threads} thread(s) each)", file=sys.stderr, flush=True)
        _wait_for_signal()
    finally:
        # Bounded: a Ray cluster that lost its control processes (a signal sent to this process's
        # whole group reaches a local cluster too) would otherwise keep this call waiting forever.
        _bounded(partial(serve.delete, APP_NAME) if args.ray_address else serve.shutdown, args.drain_timeout + 10)
        ray.shutdown()
    return 0


def local_cluster_env(host: str, port: int) -> bool:
    """Set the environment the cluster this process starts inherits; True when its ingress will
    answer HTTP directly on `port` (direct ingress, unless the environment turned it off)."""
    # A busy port is one clear error now, not a traceback from the proxy or the ingress later.
    bind(host, port).close()
    for key, value in LOCAL_CLUSTER_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] != "1":
        return False
    # Serve hands ingress replicas ports from [min, max): this range holds exactly the user's port.
    os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = str(port)
    os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] = str(port + 1)
    return True


def _bounded(call: Any, timeout: float) -> None:
    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout)


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":", 1)[0]]
    return (errors or lines or [type(exc).__name__])[-1]


def _wait_for_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
