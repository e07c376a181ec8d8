"""A small Hugging Face Hub-compatible HTTP server for tests, written with the standard library only.

It speaks the subset of the Hub's HTTP API that the unmodified ``huggingface_hub`` 2.x client uses for
``create_repo``, ``upload_folder`` / ``create_commit`` (preupload, Git LFS basic transfer, NDJSON commits, README
metadata validation), ``model_info``, ``list_repo_tree``, ``hf_hub_download`` and ``snapshot_download``, with the
status codes and error headers the client dispatches on: 409 with the repo ``url`` for an existing repo, 404 with
``X-Error-Code: EntryNotFound`` for a missing file, ``RepoNotFound`` and ``RevisionNotFound`` likewise.

Repositories live in memory: commits on ``main`` or on other branches (``create_branch``, commits with
``revision=<branch>``), tags (``create_tag``), ``list_repo_refs``; every commit is addressable by its sha, a branch or
tag by its name (or ``refs/heads/...``, ``refs/tags/...``). Faults can
be injected per endpoint (``fail_next``) to test what a client does when the Hub fails in the middle of a push, and
answers delayed (``delay_next``) to test what it does while a push is still under way.

Point a client at it with ``HF_ENDPOINT=<server.url>`` and ``HF_HUB_DISABLE_XET=1`` set before ``huggingface_hub`` is
imported (a subprocess), or in an already-running process with :func:`point_hub_client_at`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

# The real Hub stores these as LFS pointers (its default .gitattributes); everything else goes into git directly.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".npy", ".npz", ".pkl")
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
FAULT_POINTS = ("create_repo", "preupload", "lfs_batch", "lfs_upload", "commit", "resolve", "model_info", "tree")


def git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class StoredFile:
    content: bytes
    lfs_sha256: str | None  # set when the file was uploaded through Git LFS

    @property
    def blob_id(self) -> str:
        if self.lfs_sha256 is None:
            return git_blob_sha1(self.content)
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.lfs_sha256}\n"
        return git_blob_sha1(pointer.encode() + b"size %d\n" % len(self.content))


@dataclass
class Commit:
    sha: str
    summary: str
    files: dict[str, StoredFile]
    date: str


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    commits: list[Commit] = field(default_factory=list)
    # branch and tag names -> commit sha; "main" follows the last commit unless branches say otherwise
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def head(self) -> Commit:
        return self.at("main") if "main" in self.branches else self.commits[-1]

    def at(self, revision: str) -> Commit | None:
        name = revision.removeprefix("refs/heads/").removeprefix("refs/tags/")
        sha = self.branches.get(name) or self.tags.get(name)
        if sha is None and name == "main":
            return self.commits[-1]
        return next((c for c in self.commits if c.sha == (sha or revision)), None)

    def is_branch(self, revision: str) -> bool:
        return revision.removeprefix("refs/heads/") in self.branches or revision in ("main", "refs/heads/main")


class HubError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.error_code, self.extra = status, message, error_code, extra or {}


class HubState:
    """Repositories, LFS objects, the request log and pending faults; shared by all handler threads."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.calls: Counter[str] = Counter()
        self._faults: dict[str, list[int]] = {}
        self._delays: dict[str, list[float]] = {}
        self.lock = threading.RLock()

    def fail_next(self, point: str, times: int = 1, status: int = 500) -> None:
        """Answer the next ``times`` requests to ``point`` (one of FAULT_POINTS) with ``status``."""
        if point not in FAULT_POINTS:
            raise ValueError(f"Unknown fault point {point!r}; choose one of {FAULT_POINTS}.")
        with self.lock:
            self._faults.setdefault(point, []).extend([status] * times)

    def delay_next(self, point: str, seconds: float, times: int = 1) -> None:
        """Hold the next ``times`` requests to ``point`` (one of FAULT_POINTS) for ``seconds`` before answering."""
        if point not in FAULT_POINTS:
            raise ValueError(f"Unknown fault point {point!r}; choose one of {FAULT_POINTS}.")
        with self.lock:
            self._delays.setdefault(point, []).extend([seconds] * times)

    def take_fault(self, point: str) -> int | None:
        with self.lock:
            self.calls[point] += 1
            delays = self._delays.get(point)
            delay = delays.pop(0) if delays else 0.0
            pending = self._faults.get(point)
            status = pending.pop(0) if pending else None
        if delay:
            time.sleep(delay)  # outside the lock: other requests are answered meanwhile
        return status

    def repo(self, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def commit_at(self, repo: Repo, revision: str) -> Commit:
        commit = repo.at(unquote(revision))
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _front_matter(readme: bytes) -> dict[str, Any] | None:
    text = readme.decode("utf-8", errors="replace")
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, flags=re.DOTALL)
    if match is None:
        return None
    return yaml.safe_load(match.group(1)) or {}


_REPO_TYPE_PREFIXES = {"models": "model", "datasets": "dataset", "spaces": "space"}


class HubRequestHandler(BaseHTTPRequestHandler):
    server_version = "FakeHub/1.0"
    state: HubState  # set on the subclass the server builds

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class names it so
        pass  # keep test output clean; requests are recorded in state.requests instead

    # ---- plumbing ----

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def _body(self) -> bytes:
        if getattr(self, "_body_cache", None) is not None:
            return self._body_cache
        self._body_cache = self._read_body()
        return self._body_cache

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None, head: bool = False) -> None:
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})}, head)

    def _error(self, error: HubError, head: bool = False) -> None:
        headers = {"X-Error-Message": error.message}
        if error.error_code:
            headers["X-Error-Code"] = error.error_code
        self._json(error.status, {"error": error.message, **error.extra}, headers, head)

    def _dispatch(self, method: str) -> None:
        self._body_cache = None
        split = urlsplit(self.path)
        path, query = unquote(split.path), parse_qs(split.query)
        self.state.requests.append((method, self.path))
        try:
            for pattern, handler_method, handler in self._routes():
                match = re.fullmatch(pattern, path)
                if match and method in handler_method:
                    handler(self, method, query, **match.groupdict())
                    return
            raise HubError(404, f"No route for {method} {path}")
        except HubError as error:
            # Read an unread request body first, so the client sees the status instead of a reset connection.
            if method in ("POST", "PUT"):
                self._body()
            self._error(error, head=(method == "HEAD"))

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch("HEAD")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def _check_fault(self, point: str) -> None:
        status = self.state.take_fault(point)
        if status is not None:
            raise HubError(status, f"Injected server failure at {point}")

    @staticmethod
    def _routes():
        repo = r"(?P<repo_id>[^/]+/[^/]+)"
        kind = r"(?P<kind>models|datasets|spaces)"
        return [
            (r"/api/repos/create", ("POST",), HubRequestHandler.create_repo),
            (r"/api/validate-yaml", ("POST",), HubRequestHandler.validate_yaml),
            (r"/api/whoami-v2", ("GET",), HubRequestHandler.whoami),
            (rf"/api/{kind}/{repo}/preupload/(?P<revision>[^/]+)", ("POST",), HubRequestHandler.preupload),
            (rf"/api/{kind}/{repo}/commit/(?P<revision>[^/]+)", ("POST",), HubRequestHandler.commit),
            (rf"/api/{kind}/{repo}/tree/(?P<revision>[^/]+)(?:/(?P<subpath>.*))?", ("GET",), HubRequestHandler.tree),
            (rf"/api/{kind}/{repo}/refs", ("GET",), HubRequestHandler.list_refs),
            (rf"/api/{kind}/{repo}/branch/(?P<branch>[^/]+)", ("POST",), HubRequestHandler.create_branch),
            (rf"/api/{kind}/{repo}/tag/(?P<revision>[^/]+)", ("POST",), HubRequestHandler.create_tag),
            (rf"/api/{kind}/{repo}(?:/revision/(?P<revision>[^/]+))?", ("GET",), HubRequestHandler.repo_info),
            (
                rf"/(?:(?P<kind>datasets|spaces)/)?{repo}\.git/info/lfs/objects/batch",
                ("POST",),
                HubRequestHandler.lfs_batch,
            ),
            (r"/_lfs/(?P<oid>[0-9a-f]{64})", ("PUT",), HubRequestHandler.lfs_upload),
            (
                rf"/(?:(?P<kind>datasets|spaces)/)?{repo}/resolve/(?P<revision>[^/]+)/(?P<filename>.+)",
                ("GET", "HEAD"),
                HubRequestHandler.resolve,
            ),
        ]

    @staticmethod
    def _repo_type(kind: str | None) -> str:
        return _REPO_TYPE_PREFIXES.get(kind or "models", "model")

    def _repo_url(self, repo: Repo) -> str:
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        return f"{self.base_url}/{prefix}{repo.repo_id}"

    # ---- endpoints ----

    def create_repo(self, method: str, query: dict) -> None:
        self._check_fault("create_repo")
        payload = json.loads(self._body() or b"{}")
        name, organization = payload.get("name"), payload.get("organization")
        if not name:
            raise HubError(400, "A repository name is required")
        repo_id = f"{organization or 'user'}/{name}"
        repo_type = payload.get("type") or "model"
        with self.state.lock:
            existing = self.state.repos.get((repo_type, repo_id))
            if existing is not None:
                raise HubError(409, "You already created this model repo", extra={"url": self._repo_url(existing)})
            repo = Repo(repo_id, repo_type, private=payload.get("visibility") == "private")
            # The Hub initialises every repository with a .gitattributes commit.
            attributes = "".join(f"*{suffix} filter=lfs diff=lfs merge=lfs -text\n" for suffix in LFS_SUFFIXES)
            repo.commits.append(
                Commit(
                    uuid.uuid4().hex + uuid.uuid4().hex[:8],
                    "initial commit",
                    {".gitattributes": StoredFile(attributes.encode(), None)},
                    _now(),
                )
            )
            repo.branches["main"] = repo.commits[-1].sha
            self.state.repos[(repo_type, repo_id)] = repo
        self._json(200, {"url": self._repo_url(repo), "name": repo_id, "id": repo_id})

    def validate_yaml(self, method: str, query: dict) -> None:
        payload = json.loads(self._body() or b"{}")
        try:
            _front_matter(payload.get("content", "").encode())
        except yaml.YAMLError as error:
            self._json(400, {"errors": [{"message": f"Invalid YAML: {error}"}], "warnings": []})
            return
        self._json(200, {"errors": [], "warnings": []})

    def whoami(self, method: str, query: dict) -> None:
        self._json(200, {"type": "user", "name": "user", "orgs": [], "auth": {"accessToken": {"role": "write"}}})

    def preupload(self, method: str, query: dict, kind: str, repo_id: str, revision: str) -> None:
        self._check_fault("preupload")
        repo = self.state.repo(self._repo_type(kind), repo_id)
        head = self.state.commit_at(repo, revision)
        files = []
        for entry in json.loads(self._body())["files"]:
            path, size = entry["path"], entry["size"]
            mode = "lfs" if path.endswith(LFS_SUFFIXES) or size > LFS_SIZE_THRESHOLD else "regular"
            stored = head.files.get(path)
            oid = None
            if stored is not None:
                oid = stored.lfs_sha256 if stored.lfs_sha256 is not None else git_blob_sha1(stored.content)
            files.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": files, "commitOid": head.sha})

    def lfs_batch(self, method: str, query: dict, repo_id: str, kind: str | None = None) -> None:
        self._check_fault("lfs_batch")
        self.state.repo(self._repo_type(kind), repo_id)
        payload = json.loads(self._body())
        objects = []
        for obj in payload["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.state.lfs_objects:
                answer["actions"] = {"upload": {"href": f"{self.base_url}/_lfs/{obj['oid']}", "header": {}}}
            objects.append(answer)
        self._json(200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"})

    def lfs_upload(self, method: str, query: dict, oid: str) -> None:
        self._check_fault("lfs_upload")
        content = self._body()
        if hashlib.sha256(content).hexdigest() != oid:
            raise HubError(400, "LFS object does not match its sha256")
        with self.state.lock:
            self.state.lfs_objects[oid] = content
        self._send(200)

    def commit(self, method: str, query: dict, kind: str, repo_id: str, revision: str) -> None:
        self._check_fault("commit")
        repo = self.state.repo(self._repo_type(kind), repo_id)
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first line of a commit must be its header")
        header = lines[0]["value"]
        with self.state.lock:
            parent = self.state.commit_at(repo, revision)
            branch = unquote(revision).removeprefix("refs/heads/")
            if not repo.is_branch(branch):
                raise HubError(400, f"Commits go on a branch; {revision} is not one", "RevisionNotFound")
            if header.get("parentCommit") not in (None, parent.sha):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(parent.files)
            for line in lines[1:]:
                key, value = line["key"], line["value"]
                if key == "file":
                    files[value["path"]] = StoredFile(base64.b64decode(value["content"]), None)
                elif key == "lfsFile":
                    content = self.state.lfs_objects.get(value["oid"])
                    if content is None:
                        raise HubError(422, f"LFS object {value['oid']} of {value['path']} was never uploaded")
                    files[value["path"]] = StoredFile(content, value["oid"])
                elif key == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: f for p, f in files.items() if not p.startswith(prefix)}
                else:
                    raise HubError(400, f"Unknown commit operation {key!r}")
            commit = Commit(uuid.uuid4().hex + uuid.uuid4().hex[:8], header["summary"], files, _now())
            repo.commits.append(commit)
            repo.branches[branch] = commit.sha
        self._json(
            200, {"success": True, "commitOid": commit.sha, "commitUrl": f"{self._repo_url(repo)}/commit/{commit.sha}"}
        )

    def list_refs(self, method: str, query: dict, kind: str, repo_id: str) -> None:
        repo = self.state.repo(self._repo_type(kind), repo_id)
        with self.state.lock:
            branches = [
                {"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha} for name, sha in repo.branches.items()
            ]
            tags = [{"name": name, "ref": f"refs/tags/{name}", "targetCommit": sha} for name, sha in repo.tags.items()]
        self._json(200, {"branches": branches, "tags": tags, "converts": [], "pullRequests": []})

    def create_branch(self, method: str, query: dict, kind: str, repo_id: str, branch: str) -> None:
        repo = self.state.repo(self._repo_type(kind), repo_id)
        payload = json.loads(self._body() or b"{}")
        with self.state.lock:
            if branch in repo.branches or branch in repo.tags:
                raise HubError(409, f"Reference {branch} already exists")
            start = self.state.commit_at(repo, payload.get("startingPoint") or "main")
            repo.branches[branch] = start.sha
        self._json(200, {})

    def create_tag(self, method: str, query: dict, kind: str, repo_id: str, revision: str) -> None:
        repo = self.state.repo(self._repo_type(kind), repo_id)
        tag = json.loads(self._body() or b"{}").get("tag")
        if not tag:
            raise HubError(400, "A tag name is required")
        with self.state.lock:
            if tag in repo.branches or tag in repo.tags:
                raise HubError(409, f"Reference {tag} already exists")
            repo.tags[tag] = self.state.commit_at(repo, revision).sha
        self._json(200, {})

    def repo_info(self, method: str, query: dict, kind: str, repo_id: str, revision: str | None = None) -> None:
        self._check_fault("model_info")
        repo = self.state.repo(self._repo_type(kind), repo_id)
        commit = self.state.commit_at(repo, revision or "main")
        card_data = _front_matter(commit.files["README.md"].content) if "README.md" in commit.files else None
        info = {
            "_id": uuid.uuid5(uuid.NAMESPACE_URL, repo_id).hex[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit.sha,
            "lastModified": commit.date,
            "createdAt": repo.commits[0].date,
            "private": repo.private,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": list((card_data or {}).get("tags") or []),
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        }
        if card_data is not None:
            info["cardData"] = card_data
        self._json(200, info)

    def tree(self, method: str, query: dict, kind: str, repo_id: str, revision: str, subpath: str | None) -> None:
        self._check_fault("tree")
        repo = self.state.repo(self._repo_type(kind), repo_id)
        commit = self.state.commit_at(repo, revision)
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = (subpath.strip("/") + "/") if subpath else ""
        entries, folders = [], set()
        for path in sorted(commit.files):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :]
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                folder = prefix + "/".join(parts[:depth])
                if (recursive or depth == 1) and folder not in folders:
                    folders.add(folder)
                    entries.append(
                        {"type": "directory", "oid": git_blob_sha1(folder.encode()), "size": 0, "path": folder}
                    )
            if recursive or len(parts) == 1:
                stored = commit.files[path]
                entry = {"type": "file", "oid": stored.blob_id, "size": len(stored.content), "path": path}
                if stored.lfs_sha256 is not None:
                    entry["lfs"] = {"oid": stored.lfs_sha256, "size": len(stored.content), "pointerSize": 134}
                entries.append(entry)
        if subpath and not entries:
            raise HubError(404, f"{subpath} does not exist on {revision}", "EntryNotFound")
        self._json(200, entries)

    def resolve(
        self, method: str, query: dict, repo_id: str, revision: str, filename: str, kind: str | None = None
    ) -> None:
        head_only = method == "HEAD"
        self._check_fault("resolve")
        repo = self.state.repo(self._repo_type(kind), repo_id)
        commit = self.state.commit_at(repo, revision)
        stored = commit.files.get(filename)
        if stored is None:
            raise HubError(404, "Entry not found", "EntryNotFound")
        headers = {"X-Repo-Commit": commit.sha, "Content-Type": "application/octet-stream"}
        if stored.lfs_sha256 is not None:
            headers["ETag"] = f'"{stored.lfs_sha256}"'
            headers["X-Linked-Etag"] = f'"{stored.lfs_sha256}"'
            headers["X-Linked-Size"] = str(len(stored.content))
        else:
            headers["ETag"] = f'"{stored.blob_id}"'
        self._send(200, stored.content, headers, head=head_only)


class HubServer:
    """Run the fake Hub on 127.0.0.1 in a background thread; use as a context manager."""

    def __init__(self, port: int = 0) -> None:
        self.state = HubState()
        handler = type("BoundHubRequestHandler", (HubRequestHandler,), {"state": self.state})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def fail_next(self, point: str, times: int = 1, status: int = 500) -> None:
        self.state.fail_next(point, times, status)

    def delay_next(self, point: str, seconds: float, times: int = 1) -> None:
        self.state.delay_next(point, seconds, times)

    def files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, bytes]:
        """The files of a repository at a revision, as the server stores them."""
        repo = self.state.repo(repo_type, repo_id)
        return {path: stored.content for path, stored in self.state.commit_at(repo, revision).files.items()}

    def commits(self, repo_id: str, repo_type: str = "model") -> list[Commit]:
        return list(self.state.repo(repo_type, repo_id).commits)

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def hub_client_environment(endpoint: str, hf_home: str) -> dict[str, str]:
    """Environment variables that point a fresh ``huggingface_hub`` process at ``endpoint``."""
    return {
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_XET": "1",  # the server has no Xet storage: use Git LFS
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": hf_home,
        "HF_TOKEN": "hf_fake_token_for_tests",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }


def point_hub_client_at(endpoint: str, monkeypatch: Any, hf_home: str) -> None:
    """Aim the already-imported ``huggingface_hub`` (2.4) and ``transformers`` (5.x) clients at ``endpoint``.

    Both read their settings once at import: ``huggingface_hub.constants`` copies ``HF_ENDPOINT``,
    ``HF_HUB_OFFLINE``, ``HF_HUB_DISABLE_XET`` and the cache paths into module globals; the module-level
    ``huggingface_hub.hf_api.api`` keeps the endpoint it was built with, and transformers caches its own ``HfApi``.
    Patch exactly those, through ``monkeypatch`` so the test restores them. A fresh process only needs
    :func:`hub_client_environment`.
    """
    import os

    from huggingface_hub import constants, hf_api

    for key, value in hub_client_environment(endpoint, hf_home).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HOME", hf_home)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.path.join(hf_home, "hub"))
    monkeypatch.setattr(hf_api.api, "endpoint", endpoint)
    try:
        import transformers.utils.hub as transformers_hub
    except ImportError:
        return
    monkeypatch.setattr(transformers_hub, "_hf_api", None)
    for name in ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "PYTORCH_PRETRAINED_BERT_CACHE", "PYTORCH_TRANSFORMERS_CACHE"):
        if hasattr(transformers_hub, name):
            monkeypatch.setattr(transformers_hub, name, os.path.join(hf_home, "hub"))


def wait_until_listening(url: str, timeout: float = 5.0) -> None:
    """Block until the server accepts connections (it does at construction; kept for subprocess servers)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/whoami-v2", timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
