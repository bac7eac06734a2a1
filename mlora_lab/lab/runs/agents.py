"""Harness tenants from the notebook (``rl.harness``): any agent program plays their episodes.

    ep = run.agent_endpoint("agent")          # {"base_url": "http://127.0.0.1:PORT/v1", "api_key": "..."}
    client = run.agent_client("agent")        # an openai.OpenAI of it
    for e in run.episodes("agent", limit=8, wait=30):
        tid, example = e["trajectory_id"], e["example"]
        answer = client.chat.completions.create(model="agent", messages=example["messages"],
                                                extra_headers={"X-Trajectory-Id": tid})
        run.reward(tid, score(answer))        # or rewards={name: score}, metrics={...}

The job's rank 0 writes the endpoint and each harness tenant's private key into the run's ``agents.json``
(:mod:`mlora_lab.rundir.agents`, 0600) when the tenant's first generation is published; this side reads that file
and talks HTTP to the endpoint (loopback: the notebook runs on the job's machine). The protocol is the endpoint's
(:mod:`mlora_lab.agents.endpoint`): this module is a convenience over it, any program may speak it itself.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from mlora_lab.rundir import RunDir, RunState
from mlora_lab.rundir.agents import HarnessEndpoint, read_agents

AGENTS_TIMEOUT_S = 300.0
"""How long :meth:`AgentHarness.agent_endpoint` waits for the job to publish a harness tenant."""
HTTP_SLACK_S = 30.0
"""What an HTTP call may take past the wait it asked the endpoint for."""


class AgentEndpointError(RuntimeError):
    """The agents' endpoint refused a call (``status``: its HTTP status; the message is the endpoint's), or it
    is not up."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def call(
    endpoint: HarnessEndpoint, method: str, path: str, body: Any = None, timeout: float = HTTP_SLACK_S
) -> Any:
    """``method`` ``<base_url><path>`` with the tenant's key (and ``body`` as JSON): the JSON answer, or
    :class:`AgentEndpointError` with the endpoint's own message."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        endpoint.base_url + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {endpoint.api_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace")[:500]
        raise AgentEndpointError(f"HTTP {e.code}: {message}", e.code) from None
    except (urllib.error.URLError, OSError) as e:
        raise AgentEndpointError(f"the agents' endpoint {endpoint.base_url} does not answer: {e}") from None


class AgentHarness:
    """The harness side of :class:`~mlora_lab.lab.runs.run.Run` (a mixin: it uses ``self.dir``, ``self.status``,
    ``self.error`` and ``self.spec``)."""

    dir: RunDir
    status: RunState
    error: str | None
    spec: Any

    def agent_endpoint(
        self, tenant: str, timeout: float = AGENTS_TIMEOUT_S, poll: float = 0.2
    ) -> dict[str, str]:
        """Harness tenant ``tenant``'s ``{"base_url", "api_key"}`` (``base_url`` ends in ``/v1``), once the job
        has published it (at its first generation) and its endpoint answers: waits up to ``timeout`` seconds.
        :class:`ValueError` for a tenant of the job that is not a harness one; :class:`AgentEndpointError`
        when the run ends first (with its error) or the time runs out."""
        t = next((t for t in self.spec.tenants if t.name == tenant), None)
        if t is not None and not (t.rl is not None and t.rl.harness is True):
            raise ValueError(
                f"tenant {tenant!r} is not a harness tenant (RL(harness=True)) of {self.dir.root}"
            )
        deadline = time.monotonic() + timeout
        while True:
            state = self.status  # first: a file left by an earlier job of a resumed run is then seen as such
            found = (read_agents(self.dir) or {}).get(tenant)
            if state.final:
                why = f": {self.error}" if self.error else ""
                raise AgentEndpointError(
                    f"the run is {state.value}{why}; tenant {tenant!r} is not played now"
                )
            if found is not None and state is RunState.RUNNING:
                try:
                    call(found, "GET", "/models", timeout=min(HTTP_SLACK_S, max(poll, 1.0)))
                    return {"base_url": found.base_url, "api_key": found.api_key}
                except AgentEndpointError:  # (an earlier job's file, not rewritten yet)
                    pass
            if time.monotonic() >= deadline:
                raise AgentEndpointError(
                    f"harness tenant {tenant!r} of {self.dir.root} was not published within {timeout:g} s (run "
                    f"{state.value}); see run.logs(0)"
                )
            time.sleep(poll)

    def agent_client(self, tenant: str, timeout: float = AGENTS_TIMEOUT_S, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client of harness tenant ``tenant``'s endpoint (``kwargs`` go to it). Each
        request names its episode: ``extra_headers={"X-Trajectory-Id": id}`` (or ``client.with_options(
        default_headers=...)``), with ``model=tenant``. Needs ``pip install 'mlora_lab[openai]'``."""
        try:
            import openai
        except ImportError as e:
            raise ImportError("run.agent_client() needs the openai package: pip install openai") from e
        ep = self.agent_endpoint(tenant, timeout=timeout)
        return openai.OpenAI(base_url=ep["base_url"], api_key=ep["api_key"], **kwargs)

    def _harness(self, tenant: str) -> HarnessEndpoint:
        ep = self.agent_endpoint(tenant)
        return HarnessEndpoint(ep["base_url"], ep["api_key"])

    def episodes(self, tenant: str, limit: int = 1, wait: float = 0.0) -> list[dict[str, Any]]:
        """Claims up to ``limit`` of harness tenant ``tenant``'s episodes waiting to be played, waiting up to
        ``wait`` seconds for one: ``[{"trajectory_id", "example"}]`` (``[]`` when none came). A claimed
        episode is this caller's to play and reward."""
        query = urllib.parse.urlencode({"limit": int(limit), "wait": float(wait)})
        got = call(self._harness(tenant), "GET", f"/episodes?{query}", timeout=float(wait) + HTTP_SLACK_S)
        return list(got["data"])

    def reward(
        self,
        trajectory_id: str,
        value: float | None = None,
        rewards: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Posts episode ``trajectory_id``'s reward (once): ``value``, or ``rewards`` (``{name: score}`` or
        ``{name: {"score", "weight"}}``: their weighted sum, unless ``value`` is given too), with ``metrics``.
        Its tenant is the id's first part. :class:`AgentEndpointError` with the endpoint's reason when it is
        refused (a bad value, an unknown id, a second reward)."""
        if value is None and rewards is None:
            raise ValueError("run.reward needs a value or rewards={name: score}")
        body: dict[str, Any] = {}
        if value is not None:
            body["reward"] = value
        if rewards is not None:
            body["rewards"] = rewards
        if metrics is not None:
            body["metrics"] = metrics
        tenant = trajectory_id.split("/", 1)[0]
        path = "/trajectories/" + urllib.parse.quote(trajectory_id, safe="/") + "/reward"
        call(self._harness(tenant), "POST", path, body)
