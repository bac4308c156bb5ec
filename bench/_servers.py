"""The servers bench/serve.py puts side by side, each started cold and stopped again: `swarm serve` (in process
or over loopback nodes) and llama.cpp's llama-server (alone or over loopback rpc-servers)."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from pathlib import Path

from _llama import rpc_servers
from _loopback import LOOPBACK, free_port

from swarm.coordinator.cli.launch import spawn_server
from swarm.coordinator.cli.spawn import LocalNode, start_nodes, stop_nodes

N_NODES = 4  # the loopback nodes (or rpc-servers) a server spreads over


class Target:
    """A server under test: start() -> base URL of its OpenAI API; stop()."""

    name = ""
    model = ""  # the id its API serves the model under

    def start(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class SwarmServe(Target):
    def __init__(
        self,
        source: Path,
        args: list[str],
        work: Path,
        name: str,
        nodes: list[tuple[Path, list[str]]] | None = None,
    ) -> None:
        self.source, self.args, self.work, self.name, self.node_specs = source, args, work, name, nodes or []
        self.proc: LocalNode | None = None
        self.nodes: list[LocalNode] = []

    def start(self) -> str:
        peers: list[str] = []
        if self.node_specs:
            self.nodes = start_nodes(self.node_specs, self.work / "nodes", timeout=180.0)
            peers = [a for n in self.nodes for a in ("--peer", n.address)]
        self.proc = spawn_server(self.source, [*self.args, *peers], self.work, "serve").wait_ready(300)
        self.model = self.proc.ready["model_id"]
        return self.proc.ready["url"]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        stop_nodes(self.nodes)
        self.nodes = []


class LlamaServer(Target):
    """llama.cpp's server on the GGUF; with `rpc` (the rpc-server binary), its layers on N_NODES loopback
    rpc-servers of one thread each (`--rpc ... -ngl 99`: llama.cpp splits by layer), as bench/decode's RPC row."""

    def __init__(
        self,
        binary: Path,
        gguf: Path,
        threads: int,
        parallel: int,
        ctx: int,
        work: Path,
        build: str = "",
        rpc: Path | None = None,
    ) -> None:
        self.binary, self.gguf, self.threads = binary, gguf, threads
        self.parallel, self.ctx, self.work, self.rpc = parallel, ctx, work, rpc
        self.name = f"llama-server -np {parallel}" + (f", {build}" if build else "")
        self.proc: subprocess.Popen | None = None
        self.model = gguf.stem
        self.servers = contextlib.ExitStack()

    def start(self) -> str:
        port = free_port()
        cmd = [str(self.binary), "-m", str(self.gguf), "-t", str(self.threads), "-np", str(self.parallel),
               "-c", str(self.ctx * self.parallel), "--host", LOOPBACK, "--port", str(port), "-a", self.model]  # fmt: skip
        if self.rpc is not None:
            endpoints = self.servers.enter_context(rpc_servers(self.rpc, N_NODES, 1, self.work))
            cmd += ["--rpc", ",".join(endpoints), "-ngl", "99"]
        self.log = open(self.work / f"{self.name.replace(' ', '_').replace(',', '')}.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()  # the server and its rpc-servers: nothing left behind
                raise RuntimeError(f"llama-server did not come up; see {self.log.name}")
            time.sleep(0.2)
        return f"http://{LOOPBACK}:{port}/v1"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
            self.log.close()
        self.servers.close()
