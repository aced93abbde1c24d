"""One meshd daemon: wires identity, security, profiling, discovery, membership and the APIs.

Lifetimes (trio structured concurrency): `run_node` owns one nursery; the
asyncio thread that hosts grpc.aio lives exactly as long as it. Each component
runs its own tasks inside that nursery and stops by cancellation. On the way
out the peer server stops (short grace), mDNS says goodbye, and the local API
socket is removed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import trio

import partitioner
from meshd.agreement.messages import AgreementConfig
from meshd.agreement.remembered import read_remembered
from meshd.agreement.service import PlanAgreement, model_selection
from meshd.api.local_service import start_api_server
from meshd.config import Config, ConfigError
from meshd.http.server import start_http_server
from meshd.inference.fencing import CommittedPlans
from meshd.inference.install.installer import PlanInstaller
from meshd.inference.router import RequestRouter
from meshd.inference.serving.dataplane import DataPlane
from meshd.mesh import channels, process_memory, security
from meshd.mesh.gate import ConnectionGate
from meshd.mesh.identity import Identity, load_or_create_node_id
from meshd.mesh.membership import PROTOCOL_VERSION, Membership
from meshd.mesh.peer_service import PeerService
from meshd.mesh.speed_correction import Published, SpeedCorrector
from meshd.models.hub_share import DownloadBoard, HubDownloads, HubFileServer
from meshd.models.share import PartExporter
from meshd.models.tokenizer_cache import TOKENIZERS_FOLDER
from meshd.node_models import (
    check_model_type,
    hub_model_spec_dir,
    hub_snapshot_for,
    model_list,
    note_old_model_store,
    resolve_model_dir,
)
from meshd.node_status import mesh_status
from meshd.runtime import stalls
from meshd.runtime.bridge import AsyncioThread
from meshd.runtime.device import DeviceChoice, DeviceUnavailable, select_device
from meshd.runtime.events import EventLog
from meshd.runtime.rpc_guard import add_guarded_servicer
from meshd.runtime.scratch import remove_orphaned_scratch
from meshd.service import logrotate
from meshd.service.notify import notify_ready, notify_stopping
from meshd.service.supervision import (
    keep_service_manager_informed,
    ping_watchdog,
    service_state_line,
)
from meshd.state_lock import hold_state_dir
from meshd.wire import dataplane_pb2_grpc as dataplane_rpc
from meshd.wire import pb, rpc
from partitioner.humanize import format_bytes, format_flops, format_rate, format_seconds

if TYPE_CHECKING:
    from meshd.mesh.discovery_follow import FollowingDiscovery

log = logging.getLogger("meshd.node")

SERVER_GRACE_S = 0.5
LEAVE_POLL_S = 0.05
LEAVE_HAND_OVER_RESERVE_S = 2.0  # of the grace, kept for the hand-over (replays) at the end
PARTS_DIR = "parts"  # model parts fetched from peers: per node, in the state directory
DISCOVERY_PEER_SOURCE = "mdns"
# How often (in housekeeping seconds) this node compares its decode steps with the cost model.
SPEED_CORRECTION_EVERY_S = 5
MOVED_PEER_WAIT_S = 10.0  # a moved peer's old session ends within peer_timeout_s; a bound
# A profile measured under load is measured again later: at most this many times, the first
# after PROFILE_RETRY_FIRST_S, then twice as long each time (with jitter, so daemons that
# started together on one machine do not measure together again).
PROFILE_RETRIES = 4
PROFILE_RETRY_FIRST_S = 30.0
PROFILE_FIRST_WAIT_S = 10.0  # the configured model waits this long at most for the profile
OVERHEAD_CHECK_S = 2  # housekeeping ticks between readings of the process's memory beside MLX


@dataclass(frozen=True)
class NodeInfo:
    """What a started node reports to whoever started it."""

    node_id: str
    peer_port: int
    api_address: str
    http_url: str = ""
    # Leave the mesh gracefully (SIGTERM): see Node.leave. Returns once it may exit.
    leave: Callable[[], Awaitable[None]] | None = field(default=None, compare=False, repr=False)


def resolve_secret(config: Config) -> security.MeshSecret:
    """Join token (flag/config) > saved secret > a new mesh created here."""
    state_dir = config.state_dir
    saved = security.load_secret(state_dir)
    if config.join_token:
        joined = security.decode_join_token(config.join_token)
        if saved is None or saved.secret != joined.secret or saved.mesh_name != joined.mesh_name:
            security.save_secret(state_dir, joined)
            log.info("joined mesh %r with the given token", joined.mesh_name)
        return joined
    if saved is not None:
        return saved
    created = security.create_mesh_secret(config.mesh_name)
    security.save_secret(state_dir, created)
    log.info(
        "created a new mesh %r; run `meshd token` to print a join token for other machines",
        created.mesh_name,
    )
    return created


class Node:
    """The daemon's components and the status it reports."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.device = _select_device(config.device)
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self.identity = Identity(load_or_create_node_id(config.state_dir), config.name)
        self.secret = resolve_secret(config)
        self.fingerprint = security.mesh_fingerprint(self.secret)
        self.credentials = security.load_or_create_node_credentials(
            config.state_dir, self.secret, self.identity.node_id
        )
        self.events = EventLog()
        self.bridge = AsyncioThread()
        self.membership = Membership(
            self.identity,
            self.secret.mesh_name,
            self.bridge,
            self._channel,
            self.events,
            heartbeat_interval_s=config.heartbeat_interval_s,
            peer_timeout_s=config.peer_timeout_s,
            link_probe_interval_s=config.link_probe_interval_s,
            trusted_networks=tuple(config.tensor_parallel_trusted_networks),
            tensor_parallel_port=config.tensor_parallel_port,
        )
        self.gate = ConnectionGate(
            self.secret.mesh_name,
            lambda text: self.events.add("%s", text, level=logging.WARNING),
            handshake_timeout_s=config.peer_handshake_timeout_s,
        )
        self.peer_port = 0
        self.lane_port = 0  # set once at start (0: no lanes); read by status on trio
        self.mdns: FollowingDiscovery | None = None  # set when mDNS starts (not with --no-mdns)
        self._mdns_dialled: dict[str, str] = {}  # node id -> the address mDNS had us dial
        self.http_url = ""
        # The `--model` this node is checking to select for the mesh ("" when none): set and
        # cleared on trio, read by the request router (a new request waits while it is set).
        self.selecting_model = ""
        self._channel_credentials = security.channel_credentials(self.credentials)
        self._remeasure_lock = trio.Lock()
        self._measured: Any = None  # the measured NodeProfile (budget override applied)
        # What the process holds beside MLX, measured now (before any server starts) and
        # remembered from earlier runs; a budget that cannot hold it is refused here.
        self.overhead = process_memory.OverheadTracker(
            process_memory.read_remembered(config.state_dir), fixed=config.process_overhead
        )
        self.overhead.observe(process_memory.resident_beside_mlx(), stage_loaded=False)
        refusal = self.overhead.refusal(config.memory_budget)
        if refusal is not None:
            raise ConfigError(refusal)
        self._remembered_overhead = self.overhead.remembered()
        self._mlx_cache_limit: int | None = None
        self._profile_ready = trio.Event()  # set once the first profile is published
        self.speed_corrector = SpeedCorrector(self.identity.node_id)
        # Files of Hub repositories arriving here (status), and the Hub downloads shared by
        # the plan installer and the peers that ask this node for a file.
        self.hub_downloads = HubDownloads(DownloadBoard(self.identity.node_id))
        self.agreement = PlanAgreement(
            self.membership,
            self.bridge,
            self.events,
            AgreementConfig(
                join_stability_s=config.join_stability_s,
                startup_grace_s=config.startup_grace_s,
            ),
            state_dir=config.state_dir,
            mesh=self.fingerprint,
        )

    # ------------------------------------------------------------ channels and servers

    def _channel(self, address: str, for_probe: bool) -> grpc.aio.Channel:
        """A mutual-TLS channel to a peer; probes get their own TCP connection."""
        return channels.peer_channel(address, self._channel_credentials, dedicated=for_probe)

    async def _create_inference(self) -> None:
        """The data plane lives on the asyncio thread, so it is created there; the installer
        (trio side) keeps its fencing (`committed`) up to date, the router serves the API."""
        committed = CommittedPlans(self.identity.node_id)
        events, bridge = self.events, self.bridge
        self.plane = DataPlane(
            self.identity.node_id,
            channels.peer_channel_factory(self.credentials),
            committed.check,
            served=committed.view,
            resume_timeout_s=self.config.resume_timeout_s,
            max_queued_per_plan=self.config.queue_limit,
            draft_tokens=self.config.draft_tokens,
            prefix_cache=self.config.prefix_cache,
            report=lambda text: bridge.call_soon_in_trio(events.add, "%s", text),
            tokenizer_folder=self.config.model_store / TOKENIZERS_FOLDER,
        )
        self.plans = PlanInstaller(
            self.membership,
            self.agreement,
            self.bridge,
            self.events,
            self.plane,
            committed,
            self.model_dir_for_selection,
            self.config.state_dir / PARTS_DIR,
            mesh_secret=self.secret.secret,
            store_root=self.store_root,
            hub_downloads=self.hub_downloads,
        )
        plans = self.plans
        self.router = RequestRouter(
            self.plane,
            lambda: plans.snapshot,
            plans.progress,
            selecting=lambda: self.selecting_model,
        )

    async def _start_peer_server(self) -> grpc.aio.Server:
        server = channels.peer_server(self.gate.server_options())
        membership = self.membership
        hub_files = HubFileServer(
            self.store_root, self.hub_downloads, lambda: bool(membership.hub_access)
        )
        service = PeerService(
            self.membership,
            self.bridge,
            self.agreement,
            PartExporter(self._locate_model),
            hub_files,
        )
        add_guarded_servicer(rpc.add_PeerServicer_to_server, service, server)
        add_guarded_servicer(
            dataplane_rpc.add_DataPlaneServicer_to_server, self.plane.servicer(), server
        )
        address = f"{self.config.peer_host}:{self.config.peer_port}"
        try:
            port = server.add_secure_port(address, security.server_credentials(self.credentials))
        except RuntimeError:  # grpc raises when it cannot bind (older versions return 0)
            port = 0
        if port == 0:
            raise ConfigError(
                f"cannot listen for peers on {address}: the port is in use (another meshd on "
                "this machine?); give this daemon another --peer-port (0 picks a free one)"
            )
        await server.start()
        self.gate.check_installed()
        self.peer_port = port
        if self.config.lanes:
            try:
                self.lane_port = await self.plane.transport.open_lanes(
                    self.config.peer_host,
                    self.credentials,
                    port=self.config.lane_port,
                    handshake_timeout_s=self.config.peer_handshake_timeout_s,
                )
            except OSError as error:
                await server.stop(None)
                raise ConfigError(
                    f"cannot listen for lanes on {self.config.peer_host}:{self.config.lane_port}"
                    f" ({error}): give this daemon another --lane-port (0 picks a free one)"
                ) from None
        return server

    # ------------------------------------------------------------ status

    def status(self) -> pb.MeshStatus:
        """This node's view of the mesh, for `meshd status` and the APIs."""
        return mesh_status(self)

    def list_models(self) -> pb.ModelList:
        selection = self.agreement.selection
        return model_list(self.store_root, selection.name if selection else "")

    def token(self) -> pb.TokenReply:
        return pb.TokenReply(
            token=security.encode_join_token(self.secret),
            mesh_name=self.secret.mesh_name,
            fingerprint=self.fingerprint,
        )

    async def wait_changed(self) -> None:
        """Until the peer table or the agreement changes (what `WatchStatus` shows)."""
        with (
            self.membership.changes.subscribe() as mesh,
            self.agreement.changes.subscribe() as plans,
        ):
            async with trio.open_nursery() as nursery:
                for feed in (mesh, plans):
                    nursery.start_soon(_first_item_cancels, feed, nursery.cancel_scope)

    @property
    def store_root(self) -> Path:
        """The user's model store (shared by the user's daemons; see `Config.model_store`)."""
        return self.config.model_store

    async def select_model(
        self,
        model: str,
        *,
        strategy: str | None = None,
        context_length: int | None = None,
        concurrency: int | None = None,
        parallelism: str | None = None,
        startup_default: bool = False,
    ) -> pb.ModelSelection:
        """Read the model's description (no weights) and propose it to the mesh.

        `model` is a model directory, a .gguf file (imported into the store first), or a
        name in this node's store; the embedded default is imported on first use.
        `startup_default`: the configured model, offered at start; it never replaces a model
        loaded on purpose (see `meshd.agreement.service.winning_selection`).
        """
        from meshd.models.info import read_model_spec

        hub_model = await trio.to_thread.run_sync(
            hub_model_spec_dir, self.store_root, self.config.state_dir, model
        )
        if hub_model is not None:  # ORG/NAME[@REV]: described from config and headers alone
            model_dir, selection_path = hub_model
        else:
            model_dir = await trio.to_thread.run_sync(
                resolve_model_dir, self.store_root, model, self.events
            )
            selection_path = str(model_dir)
        # Refuse an architecture stages cannot run before the mesh re-plans for it.
        await trio.to_thread.run_sync(check_model_type, model_dir)
        spec = await trio.to_thread.run_sync(read_model_spec, model_dir)
        if hub_model is not None:
            spec = dataclasses.replace(spec, name=model.split("@")[0])
        options = partitioner.PlanOptions(
            strategy=strategy or self.config.strategy,
            context_length=context_length or self.config.context_length,
            concurrency=concurrency or self.config.concurrency,
            cache_sequences=self.config.prefix_cache_sequences if self.config.prefix_cache else 0,
            parallelism=parallelism or self.config.parallelism,
            min_gain=self.config.min_gain,
        )
        selection = model_selection(
            spec,
            options,
            self.identity.node_id,
            selection_path,
            startup_default=startup_default,
            after=None if startup_default else self.agreement.selection,
        )
        current = self.membership.model
        if startup_default and current is not None and not current.startup_default:
            # Peers told this node about a loaded model while it read its own: keep that.
            self.events.add(
                "configured model %s: the mesh runs %s, loaded on %s (meshd load %s switches)",
                spec.name,
                current.name,
                current.set_by,
                model,  # as configured: a directory outside the store is not a name there
            )
            return selection
        self.membership.set_model(selection)
        self.events.add(
            "%s model %s (%d layers, %s of weights)",
            "offering configured" if startup_default else "selected",
            spec.name,
            spec.num_layers,
            format_bytes(spec.total_weight_bytes),
        )
        return selection

    async def _select_configured_model(self, model: str) -> None:
        # Checking a model imports mlx-lm (a second of CPU, holding the GIL): not while this
        # node measures its profile, which would take that for a slower machine. No plan is
        # made without the profile anyway. Meanwhile requests wait for it (selecting_model).
        self.selecting_model = model
        try:
            with trio.move_on_after(PROFILE_FIRST_WAIT_S):
                await self._profile_ready.wait()
            await self.select_model(model, startup_default=True)
        except Exception as exc:
            self.events.add("cannot use model %r: %s", model, exc, level=logging.ERROR)
        finally:
            self.selecting_model = ""

    async def _locate_model(self, name: str, digest: str) -> Path | None:
        """asyncio side: this node's full copy of model (name, digest), to send parts of to
        peers. The selection is read on trio, which owns it; the disk in a worker thread."""
        selection = await self.bridge.call_in_trio(self._selection_named, name, digest)
        if selection is None:
            return None
        try:
            return await asyncio.to_thread(self.model_dir_for_selection, selection)
        except Exception:
            return None

    def _selection_named(self, name: str, digest: str) -> pb.ModelSelection | None:
        """The mesh's selected model if it is (name, digest): only its parts are sent."""
        selection = self.agreement.selection
        if selection is None or (selection.name, selection.digest) != (name, digest):
            return None
        return selection

    def model_dir_for_selection(self, selection: pb.ModelSelection) -> Path:
        """This node's full copy of the selected model: the directory it selected itself
        (`meshd load DIR`, `--model DIR`), else its store (a peer's selection)."""
        from meshd.inference.install.installer import model_dir_for

        snapshot = hub_snapshot_for(self.store_root, selection.path)
        if snapshot is not None:  # hf:ORG/NAME@COMMIT, complete in this node's HF cache
            return snapshot
        own = self.config.model
        if selection.set_by == self.identity.node_id and selection.path:
            own = selection.path
        return model_dir_for(selection, own, self.store_root)

    async def remeasure(self) -> None:
        await self._measure_profile(remeasure=True)

    async def _measure_profile(self, *, remeasure: bool) -> Any:
        """Measure (or read the cached profile), publish it, say so; returns the profile.

        A re-measure is settled against the cached one (``profiling.settle_profile``): a
        loaded measurement keeps a quiet one, numbers within the spread stay as they were, so
        only a real change makes a new digest and a new plan."""
        from meshd.mesh.profiling import load_or_measure_profile, measure_and_settle

        budget = self.config.memory_budget
        async with self._remeasure_lock:
            if remeasure:
                measured = await trio.to_thread.run_sync(
                    lambda: measure_and_settle(self.config.state_dir)
                )
                profile = measured.published
                if budget is not None:
                    profile = profile.with_memory_budget(budget)
            else:
                measured = None
                profile = await trio.to_thread.run_sync(
                    lambda: load_or_measure_profile(
                        self.config.state_dir, memory_budget_override=budget
                    )
                )
        previous, self._measured = self._measured, profile
        self._publish_profile()
        self._profile_ready.set()
        import mlx.core as mx

        mx.reset_peak_memory()  # the benchmark's buffers are not the model's memory
        self.events.add(
            "%s; computing on %s",
            _profile_line(profile, previous, measured, self.overhead.planned),
            self.device.summary,
        )
        return profile

    def _publish_profile(self) -> None:
        """Gossip the measured profile with the process overhead planned now."""
        from meshd.mesh.profiling import profile_to_proto

        if self._measured is None:
            return
        profile = dataclasses.replace(
            self._measured,
            process_overhead=self.overhead.planned,
            device_reason=self.device.reason,
        )
        self.membership.set_profile(
            profile_to_proto(profile, self.identity.node_id, self.config.name)
        )

    # ------------------------------------------------------------ run

    async def run(
        self, *, task_status: trio.TaskStatus[NodeInfo] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with self.bridge:
            await self.bridge.run(self._create_inference)
            peer_server = await self.bridge.run(self._start_peer_server)
            self.membership.grpc_port = self.peer_port
            api_server = await self.bridge.run(
                start_api_server, self, self.bridge, self.config.api_address
            )
            http_server = None
            try:
                http_server = await self.bridge.run(
                    start_http_server,
                    self,
                    self.bridge,
                    self.config.http,
                    self.config.state_dir,
                    self.config.cors_origins,
                )
                self.http_url = http_server.url if http_server else ""
                note_old_model_store(self.config.state_dir, self.store_root, self.events)
                await trio.to_thread.run_sync(remove_orphaned_scratch)
                remembered = await trio.to_thread.run_sync(read_remembered, self.config.state_dir)
                if remembered is not None:
                    self.agreement.remember(remembered)
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.membership.run)
                    nursery.start_soon(self._measure_profile_task)
                    if self.config.model:
                        nursery.start_soon(self._select_configured_model, self.config.model)
                    await nursery.start(self.plans.run)  # subscribes before any plan exists
                    await nursery.start(self.agreement.run)
                    for address in self.config.peers:
                        self.membership.want(address, "static")
                    if self.config.mdns:
                        await nursery.start(self._discovery_task)
                    nursery.start_soon(self._housekeeping)
                    nursery.start_soon(self._watch_stalls)
                    nursery.start_soon(
                        keep_service_manager_informed,
                        self._service_state_line,
                        partial(self.bridge.run, ping_watchdog),
                    )
                    self.events.add(
                        "node %s up: mesh %r, peers on port %d, API on %s, dashboard %s",
                        self.identity.node_id,
                        self.secret.mesh_name,
                        self.peer_port,
                        self.config.api_address,
                        f"{self.http_url}/" if self.http_url else "off",
                    )
                    task_status.started(
                        NodeInfo(
                            self.identity.node_id,
                            self.peer_port,
                            self.config.api_address,
                            self.http_url,
                            leave=self.leave,
                        )
                    )
                    notify_ready(self.config.api_address)  # systemd Type=notify; no-op elsewhere
            finally:
                with trio.CancelScope(shield=True):
                    if http_server is not None:
                        await self.bridge.run(http_server.stop)
                    await self.bridge.run(_stop_servers, peer_server, api_server)
                    await self.bridge.run(self.plane.close)
                    self.hub_downloads.close()
                    _remove_socket(self.config.api_address)

    async def leave(self) -> None:
        """Leave the mesh without losing a request (SIGTERM; bounded by ``leave_grace_s``).

        This node stops taking requests and publishes ``leaving`` in its gossiped state; the
        peers commit a plan without it and load it (:meth:`PlanAgreement.peers_ready_without`),
        while this node's stages keep serving the requests running through them. Once it is
        loaded, their origins move them to it in the background (the old attempt streams on
        through this node while the new one catches up, see
        :mod:`meshd.inference.origin.core`), and this node waits until none runs through its
        stages any more. Then the plans with a
        stage here are uninstalled: a request still running through it (its origin could not
        move it in time) ends here with a failure its origin moves it on by (a replay of its
        tokens on the plan it serves now). Requests this node is the origin of get the rest of
        the grace to finish. Returns when all that is done or the grace is over; the caller
        then stops the node.
        """
        grace = self.config.leave_grace_s
        deadline = trio.current_time() + grace
        notify_stopping(grace)  # systemd: give the leave its grace before it kills us
        reason = f"node {self.identity.node_id} is leaving the mesh"
        await self.bridge.run(self.router.stop_taking_requests, reason + ": ask another node")
        self.membership.set_leaving()
        self.events.add("leaving the mesh: new requests are refused (grace %.1f s)", grace)
        # Keep serving until the peers' plan without this node is loaded on its stages: the
        # requests then move there in the background, waiting for no load.
        with trio.move_on_at(deadline):
            while not self.agreement.peers_ready_without(self._loaded_plans_of):
                await trio.sleep(LEAVE_POLL_S)
        if not self.agreement.peers_ready_without(self._loaded_plans_of):
            self.events.add(
                "leaving: the peers did not re-plan and load without this node within %.1f s; "
                "its requests move now",
                grace,
                level=logging.WARNING,
            )
        else:
            await self._wait_for_moves(deadline - min(LEAVE_HAND_OVER_RESERVE_S, grace / 4))
        handed = await self.bridge.run(self.plane.hand_over_stages, reason)
        if handed:
            self.events.add(
                "leaving: handed over the requests of plan(s) %s",
                ", ".join(plan_id[:12] for plan_id in handed),
            )
        with trio.move_on_at(deadline):
            while self.router.in_flight:
                await trio.sleep(LEAVE_POLL_S)
        left = len(self.router.in_flight)
        if left:
            self.events.add(
                "leaving: %d request(s) this node is the origin of did not finish within "
                "%.1f s; their clients lose their connection",
                left,
                grace,
                level=logging.WARNING,
            )
        else:
            self.events.add("left the mesh")

    async def _wait_for_moves(self, deadline: float) -> None:
        """Keep serving until the requests running through this node's stages have moved
        (their origins switch them to the peers' plan in the background), or ``deadline``."""
        held = await self.bridge.run(self.plane.stage_requests_held)
        if not held:
            return
        self.events.add(
            "leaving: %d request(s) running through this node move to the peers' plan", held
        )
        started = trio.current_time()
        with trio.move_on_at(deadline):
            while held:
                await trio.sleep(LEAVE_POLL_S)
                held = await self.bridge.run(self.plane.stage_requests_held)
        if held:
            self.events.add(
                "leaving: %d request(s) did not move within %.1f s; they are handed over",
                held,
                trio.current_time() - started,
                level=logging.WARNING,
            )
        else:
            self.events.add(
                "leaving: the requests moved off this node in %.2f s",
                trio.current_time() - started,
            )

    def _loaded_plans_of(self, node_id: str) -> tuple[str, ...]:
        """The plans a node says (gossiped NodeState) it has loaded; this node's own too."""
        if node_id == self.identity.node_id:
            return self.membership.loaded_plans
        record = self.membership.peers.get(node_id)
        if record is None or record.state is None:
            return ()
        return tuple(record.state.loaded_plans)

    async def _measure_profile_task(self) -> None:
        """Measure at start; a measurement under load is measured again, a bounded number of
        times with backoff, until one is quiet (it then replaces the loaded one)."""
        profile = await self._measure_profile(remeasure=False)
        delay = PROFILE_RETRY_FIRST_S
        for _ in range(PROFILE_RETRIES):
            if not profile.loaded:
                return
            await trio.sleep(delay * random.uniform(0.75, 1.25))
            profile = await self._measure_profile(remeasure=True)
            delay *= 2
        if profile.loaded:
            self.events.add(
                "profile: still measured under load after %d re-measures; planning with the "
                "fastest so far (`meshd profile --remeasure` measures again)",
                PROFILE_RETRIES,
                level=logging.WARNING,
            )

    async def _check_process_memory(self) -> None:
        """Read what the process holds beside MLX; plan a larger overhead when it outgrew
        the planned one (a new profile digest: the mesh re-plans with less here), remember
        the most it held for the next start, and bound MLX's cache by the plan's slack."""
        stage_loaded = bool(self.membership.loaded_plans)
        reading = process_memory.resident_beside_mlx()
        if self.overhead.outgrows(reading, stage_loaded=stage_loaded):
            # Freed heap glibc keeps resident is not overhead: give it back, read again.
            await trio.to_thread.run_sync(process_memory.release_freed_heap)
            reading = process_memory.resident_beside_mlx()
        if self.overhead.observe(reading, stage_loaded=stage_loaded):
            self.events.add(
                "process overhead: %s held beside MLX's memory (most: %s); plans now reserve %s "
                "of the budget for it",
                format_bytes(self.overhead.last),
                format_bytes(self.overhead.high_water),
                format_bytes(self.overhead.planned),
            )
            self._publish_profile()
        remembered = self.overhead.remembered()
        if (
            remembered.high_water > self._remembered_overhead.high_water + 8 * 2**20
            or remembered.loaded_before != self._remembered_overhead.loaded_before
        ):
            self._remembered_overhead = remembered
            try:
                await trio.to_thread.run_sync(
                    process_memory.write_remembered, self.config.state_dir, remembered
                )
            except OSError as exc:
                log.warning("cannot remember the process overhead: %s", exc)
        self._bound_mlx_cache()

    def _bound_mlx_cache(self) -> None:
        """MLX keeps freed buffers for reuse; they count in RSS, so they must fit in the
        allocator slack the active plan reserves here (unbounded while no plan is active)."""
        import mlx.core as mx

        active = self.agreement.core.active
        plan = self.agreement.plan_for(active.proposal) if active else None
        share = plan.memory_of(self.identity.node_id) if plan else None
        if share is None:
            return
        limit = process_memory.mlx_cache_limit(share.overhead_bytes)
        if limit != self._mlx_cache_limit:
            mx.set_cache_limit(limit)
            self._mlx_cache_limit = limit

    def _publish_hub_state(self) -> None:
        """Gossip the files arriving here (once a second at most) and whether this node's
        last Hub request reached the Hub (peers split a repository's downloads by it)."""
        from meshd.models.hub import hub_reachable

        self.membership.set_downloads(self.hub_downloads.board.snapshot())
        reachable = hub_reachable()
        if reachable is not None:
            self.membership.set_hub_access(reachable)

    async def _housekeeping(self) -> None:
        ticks = 0
        log_file = logrotate.log_to_rotate()  # launchd's log file, which nothing else rotates
        while True:
            await trio.sleep(1)
            self.gate.check()  # who knocked on the peer port without the mesh's certificate
            self._publish_hub_state()
            ticks += 1
            if ticks % OVERHEAD_CHECK_S == 0:
                await self._check_process_memory()
            if self.config.speed_correction and ticks % SPEED_CORRECTION_EVERY_S == 0:
                self._correct_speed()
            if ticks % 10 == 0:
                self.membership.forget_old()
            if log_file is not None and ticks % logrotate.ROTATE_CHECK_S == 0:
                await self._rotate_log(log_file)

    def _correct_speed(self) -> None:
        """Publish this node's speed correction when its decode steps on the active plan
        moved it past the threshold (meshd.mesh.speed_correction); every node plans with it."""
        plane = getattr(self, "plane", None)  # created once the asyncio thread runs
        active = self.agreement.core.active
        selection = self.agreement.selection
        if plane is None or active is None or selection is None:
            return
        plan = self.agreement.plan_for(active.proposal)
        if plan is None or not (plane.stage.decode_steps or plane.stage.prompt_chunks):
            return
        spec = partitioner.ModelSpec.from_dict(json.loads(selection.spec_json))
        if spec.name != plan.model_name:
            return
        profile = self.membership.profile
        current = self.membership.speed_correction or pb.SpeedCorrection()
        found = self.speed_corrector.update(
            spec,
            plan,
            profile.flops,
            profile.mem_bandwidth,
            plane.stage.decode_steps,
            plane.stage.prompt_chunks,
            Published(
                current.factor,
                current.row_flops,
                current.compute_factor,
                current.collective_overhead_s,
            ),
            trio.current_time(),
        )
        if found is None:
            return
        self.membership.set_speed_correction(
            pb.SpeedCorrection(
                node_id=self.identity.node_id,
                factor=found.factor,
                samples=found.samples or current.samples,
                measured_step_s=found.measured_step_s or current.measured_step_s,
                predicted_step_s=found.predicted_step_s or current.predicted_step_s,
                updated_at=time.time(),
                plan_id=plan.plan_id,
                row_flops=found.row_flops,
                compute_factor=found.compute_factor,
                prompt_samples=found.prompt_samples or current.prompt_samples,
                collective_overhead_s=found.collective_overhead_s,
            )
        )
        rows = f", each batched row {format_flops(found.row_flops)}" if found.row_flops else ""
        compute = f", prompts {found.compute_factor:.2f}x" if found.compute_factor else ""
        if found.collective_overhead_s:
            compute += f", collectives {format_seconds(found.collective_overhead_s)} each"
        self.events.add(
            "speed correction %.2fx: decode steps took %s, the profile predicts %s%s%s; "
            "plans now use it",
            found.factor,
            format_seconds(found.measured_step_s or current.measured_step_s),
            format_seconds(found.predicted_step_s or current.predicted_step_s),
            compute,
            rows,
        )

    async def _rotate_log(self, log_file: Path) -> None:
        try:
            await trio.to_thread.run_sync(logrotate.rotate_if_large, log_file)
        except OSError as exc:
            log.warning("cannot rotate the log file %s: %s", log_file, exc)

    async def _watch_stalls(self) -> None:
        """Say in the event log when a loop of this daemon did not run for a while (peers
        may have dropped it meanwhile): see meshd.runtime.stalls."""
        timeout = self.config.peer_timeout_s
        asyncio_loop = stalls.StallCounter(
            "asyncio loop (heartbeats, peer port, data plane)", timeout
        )
        trio_loop = stalls.StallCounter("trio loop (agreement, status)", timeout)

        def from_asyncio(message: str) -> None:
            self.bridge.call_soon_in_trio(self._stalled, message)

        trace = stalls.open_trace()  # MESHD_STALL_TRACE: the asyncio loop's stalls, traced
        watch_asyncio = partial(
            stalls.watch, asyncio.sleep, asyncio_loop, from_asyncio, trace=trace
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stalls.watch, trio.sleep, trio_loop, self._stalled)
                nursery.start_soon(self.bridge.run, watch_asyncio)
        finally:
            if trace is not None:
                trace.close()

    def _service_state_line(self) -> str:
        """What `systemctl status` shows: serving, loading, re-planning, no model, leaving."""
        if self.membership.leaving:
            return f"leaving the mesh (up to {self.config.leave_grace_s:g} s)"
        return service_state_line(self.agreement.status_message(), self.plans.moving)

    def _stalled(self, message: str) -> None:
        self.events.add(message, level=logging.WARNING)

    async def _discovery_task(self, *, task_status: trio.TaskStatus[None]) -> None:
        from meshd.mesh import discovery
        from meshd.mesh.announcement import Announcement
        from meshd.mesh.discovery_follow import FollowingDiscovery

        own = Announcement(
            node_id=self.identity.node_id,
            mesh_name=self.secret.mesh_name,
            protocol_version=PROTOCOL_VERSION,
            grpc_port=self.peer_port,
            fingerprint=self.fingerprint,
        )
        send, receive = trio.open_memory_channel[discovery.DiscoveryEvent](256)
        self.mdns = FollowingDiscovery(
            own,
            self.config.interfaces or None,
            self.config.skip_interfaces,
            send,
            lambda text, level: self.events.add("%s", text, level=level),
        )
        async with trio.open_nursery() as nursery:
            # Peers found while our own registration (~0.5 s) is still going out are dialled
            # at once; they learn of this node from the inbound call and dial back.
            nursery.start_soon(self._follow_discovery, receive)
            await nursery.start(self.mdns.run)
            task_status.started()

    async def _follow_discovery(self, receive: trio.MemoryReceiveChannel) -> None:
        async with trio.open_nursery() as nursery:
            async for event in receive:
                self._on_discovery(event, nursery)

    def _on_discovery(self, event: object, nursery: trio.Nursery) -> None:
        from meshd.mesh import discovery

        if isinstance(event, discovery.PeerAppeared | discovery.PeerUpdated):
            ann = event.announcement
            hosts = [f"[{h}]" if ":" in h else h for h in ann.addresses]
            dialled = self._mdns_dialled.get(ann.node_id)
            announced = [f"{host}:{ann.grpc_port}" for host in hosts]
            if not announced:
                return
            if dialled is None or dialled in announced:  # new, or still announced there
                address = dialled or announced[0]
                self._mdns_dialled[ann.node_id] = address
                self.membership.want(address, DISCOVERY_PEER_SOURCE)
                return
            address = self._mdns_dialled[ann.node_id] = announced[0]
            self.events.add(
                "peer %s moved: mDNS announces it at %s, no longer at %s",
                ann.node_id,
                address,
                dialled,
            )
            nursery.start_soon(self._dial_moved_peer, ann.node_id, dialled, address)
        elif isinstance(event, discovery.PeerGone):
            log.info("mDNS goodbye from %s (%s)", event.node_id, event.reason)
            self._mdns_dialled.pop(event.node_id, None)
            self.membership.unwant_peer(event.node_id, "mDNS goodbye")

    async def _dial_moved_peer(self, node_id: str, old: str, new: str) -> None:
        """Dial a peer's new address once its session at the old one has ended: while that
        session lives, membership would take the new address for a duplicate and drop it.
        The old address, no longer announced, is not redialled."""
        with self.membership.changes.subscribe() as changes, trio.move_on_after(MOVED_PEER_WAIT_S):
            while (record := self.membership.peers.get(node_id)) and record.alive:
                if record.address != old:
                    break
                await changes.receive()
        if self._mdns_dialled.get(node_id) == new:  # else it moved again meanwhile
            self.membership.unwant(old, f"{node_id} moved to {new}")
            self.membership.want(new, DISCOVERY_PEER_SOURCE)


def _profile_line(profile: Any, previous: Any, measured: Any, overhead: int) -> str:
    """The event log's line for a (re-)measured profile: its numbers with their spread,
    whether it was measured under load, and what a re-measure did to the plan."""
    numbers = (
        f"{format_flops(profile.flops)} (±{50 * profile.flops_spread:.0f}%), "
        f"{format_rate(profile.mem_bandwidth)} memory (±{50 * profile.mem_bandwidth_spread:.0f}%)"
        f", budget {format_bytes(profile.memory_budget)}, process overhead "
        f"{format_bytes(overhead)} ({profile.blas})"
    )
    if measured is not None and measured.kept_quiet:
        fresh = measured.fresh
        return (
            f"profile measured again under load ({format_flops(fresh.flops)}, other processes "
            f"used {fresh.other_busy_cores:.1f} cores): kept the quiet measurement, {numbers}"
        )
    if previous is not None and (profile.flops, profile.mem_bandwidth) == (
        previous.flops,
        previous.mem_bandwidth,
    ):
        return f"profile measured again, no change beyond its spread: the plan keeps {numbers}"
    load = (
        f"; measured under load (other processes used {profile.other_busy_cores:.1f} cores): "
        "not planned as a slow machine, measured again later"
        if profile.loaded
        else ""
    )
    return f"profile measured: {numbers}{load}"


async def _first_item_cancels(feed: trio.MemoryReceiveChannel, scope: trio.CancelScope) -> None:
    await feed.receive()
    scope.cancel()


async def _stop_servers(*servers: grpc.aio.Server) -> None:
    for server in servers:
        await server.stop(SERVER_GRACE_S)


def _remove_socket(address: str) -> None:
    if address.startswith("unix:"):
        Path(address.removeprefix("unix:")).unlink(missing_ok=True)


def _select_device(requested: str) -> DeviceChoice:
    """The device this daemon and the processes it spawns compute on (meshd.runtime.device);
    ConfigError, naming what to install, for a forced GPU that MLX does not report."""
    from meshd.mesh.profiling import cpu_model

    try:
        return select_device(requested, cpu_name=cpu_model())
    except DeviceUnavailable as error:
        raise ConfigError(str(error)) from error


async def run_node(
    config: Config, *, task_status: trio.TaskStatus[NodeInfo] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run one daemon until cancelled; StateDirInUse when another daemon holds its state
    directory (checked before anything in it is read, written, bound or removed)."""
    with hold_state_dir(config.state_dir):
        await Node(config).run(task_status=task_status)
