"""A fake Hugging Face Hub on 127.0.0.1 with the endpoints huggingface_hub's
``HfFileSystem`` uses (reached through ``HF_ENDPOINT``), for model repos made
from local folders. Plain HTTP only: nothing advertises Xet.

- ``GET /api/models/{repo}[/revision/{rev}]``: repo info (sha, siblings)
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=&cursor=``:
  entries, ``page_size`` per page (``expand_page_size`` with expand) and a
  ``Link: <...>; rel="next"`` header, like the Hub's cursor pagination
- ``POST /api/models/{repo}/paths-info/{rev}`` (form ``paths``, ``expand``)
- ``GET /api/models/{repo}/commits/{rev}``
- ``GET|HEAD /{repo}/resolve/{rev}/{path}``: small (git) files answered
  directly (ETag = git blob id); LFS files (by suffix, like the Hub's default
  .gitattributes, or ``lfs_threshold`` bytes and more) answered like the Hub: a
  302 carrying ``X-Linked-Etag: "<sha256>"``, ``X-Linked-Size``, to
  ``/cdn-lfs/{sha256}``, which serves the bytes (ranges, ETag ``"<sha256>"``).
  ``redirect_lfs = False`` serves LFS files directly instead. Every resolve
  answer carries ``X-Repo-Commit``.

Tree and paths-info entries of LFS files have ``lfs: {oid: sha256, size,
pointerSize}`` (the wire names; huggingface_hub turns them into
``BlobLfsInfo(sha256=..., size=..., pointer_size=...)``).

Errors are the Hub's: unknown repo or missing token 401 ``X-Error-Code:
RepoNotFound`` (gated repos: file downloads only, ``GatedRepo``), wrong token
401 "Invalid credentials in Authorization header", unknown revision 404
``RevisionNotFound``, unknown path 404 ``EntryNotFound``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote

from remote_servers import Incoming, LoggedServer, Reply, serve_bytes

LFS_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".pkl",
    ".pickle", ".npy", ".npz", ".gguf", ".zip", ".tar", ".gz", ".zst", ".parquet", ".model",
)  # fmt: skip
DATE = "2024-05-01T12:00:00.000Z"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
    ).encode()


@dataclass
class Blob:
    data: bytes
    lfs: bool

    def __post_init__(self) -> None:
        self.sha256 = hashlib.sha256(self.data).hexdigest()
        self.pointer = lfs_pointer(self.sha256, len(self.data))
        self.oid = git_blob_id(self.pointer if self.lfs else self.data)


@dataclass
class Commit:
    sha: str
    title: str
    files: dict[str, Blob]
    parent: str | None

    def dirs(self) -> set[str]:
        out = set()
        for path in self.files:
            parts = path.split("/")[:-1]
            out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        return out


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    token: str | None = None
    gated: bool = False


class FakeHub(LoggedServer):
    """``FakeHub({"org/name": folder})``; more with ``add_repo``/``add_commit``."""

    def __init__(
        self, repos: dict[str, Path] | None = None, *, lfs_threshold: int = 10 * 2**20
    ) -> None:
        super().__init__()
        self.lfs_threshold = lfs_threshold
        self.redirect_lfs = True
        self.scans: dict[str, dict[str, object]] = {}  # repo -> its securityRepoStatus
        self.page_size = 1000  # the Hub's tree page sizes
        self.expand_page_size = 50
        self.repos: dict[str, Repo] = {}
        self._blobs: dict[str, Blob] = {}  # sha256 -> blob, for /cdn-lfs
        for repo_id, folder in (repos or {}).items():
            self.add_repo(repo_id, folder)

    def clear(self) -> None:
        """Forget every repo, empty the log, drop the faults."""
        self.repos.clear()
        self._blobs.clear()
        self.redirect_lfs = True
        self.scans = {}
        self.page_size, self.expand_page_size = 1000, 50
        self.reset()

    def add_repo(
        self, repo_id: str, folder: Path, *, token: str | None = None, gated: bool = False
    ) -> str:
        """A repo whose branch ``main`` holds a copy of ``folder`` (read now);
        returns the commit sha. With ``token``, requests need ``Authorization:
        Bearer <token>``: all of them (private), or only file downloads
        (``gated``)."""
        self.repos[repo_id] = Repo(repo_id, token=token, gated=gated)
        return self.add_commit(repo_id, folder, title="initial commit")

    def add_commit(
        self, repo_id: str, folder: Path, *, branch: str = "main", title: str = "update"
    ) -> str:
        """A new commit on ``branch`` holding a copy of ``folder``; returns its
        sha. Older commits stay reachable by their sha."""
        repo = self.repos[repo_id]
        files = {}
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                data = path.read_bytes()
                name = path.relative_to(folder).as_posix()
                lfs = name.endswith(LFS_SUFFIXES) or len(data) >= self.lfs_threshold
                files[name] = Blob(data, lfs)
                self._blobs[files[name].sha256] = files[name]
        parent = repo.branches.get(branch)
        seed = f"{repo_id}\n{parent}\n{len(repo.commits)}\n" + "".join(
            f"{name} {blob.oid}\n" for name, blob in files.items()
        )
        sha = hashlib.sha1(seed.encode()).hexdigest()
        repo.commits[sha] = Commit(sha, title, files, parent)
        repo.branches[branch] = sha
        return sha

    # -- routing -----------------------------------------------------------

    def handle(self, req: Incoming) -> Reply:
        parts = [unquote(p) for p in req.raw_path.split("/")[1:]]
        if parts[:2] == ["api", "agent-harnesses"]:  # huggingface_hub's user-agent probe
            body = json.dumps({"standardEnvVars": [], "harnesses": {}}).encode()
            return Reply(200, [("Content-Type", "application/json")], body, quiet=True)
        if len(parts) == 2 and parts[0] == "cdn-lfs" and req.method in ("GET", "HEAD"):
            blob = self._blobs.get(parts[1])
            if blob is None:
                return _error(404, "EntryNotFound", "blob not found")
            return serve_bytes(blob.data, f'"{blob.sha256}"', req, [])
        if len(parts) >= 4 and parts[0] == "api" and parts[1] == "models":
            return self._api(req, "/".join(parts[2:4]), parts[4:])
        if len(parts) >= 5 and parts[2] == "resolve" and req.method in ("GET", "HEAD"):
            return self._resolve(req, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        return _error(404, None, "no such endpoint")

    def _find(
        self, req: Incoming, repo_id: str, rev: str | None, *, is_file: bool
    ) -> Reply | Commit:
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(401, "RepoNotFound", "Repository not found")
        if repo.token is not None:
            auth = req.headers.get("authorization")
            if auth is None and (is_file or not repo.gated):
                code = "GatedRepo" if repo.gated else "RepoNotFound"
                return _error(401, code, "Access to this repo is restricted")
            if auth is not None and auth != f"Bearer {repo.token}":
                return _error(401, None, "Invalid credentials in Authorization header")
        sha = repo.branches.get(rev or "main", rev)
        if sha not in repo.commits:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo.commits[sha]

    def _api(self, req: Incoming, repo_id: str, rest: list[str]) -> Reply:
        if not rest or rest[0] == "revision":
            commit = self._find(req, repo_id, rest[1] if len(rest) > 1 else None, is_file=False)
            if isinstance(commit, Reply):
                return commit
            return _json(self._repo_info(repo_id, commit))
        if len(rest) < 2:
            return _error(404, None, "no such endpoint")
        commit = self._find(req, repo_id, rest[1], is_file=False)
        if isinstance(commit, Reply):
            return commit
        expand = _flag(req.params.get("expand", ["false"])[0])
        if rest[0] == "tree" and req.method == "GET":
            return self._tree(req, commit, "/".join(rest[2:]), expand)
        if rest[0] == "paths-info" and req.method == "POST":
            form = parse_qs(req.body.decode(), keep_blank_values=True)
            expand = _flag(form.get("expand", ["false"])[0])
            found = [self._entry(commit, p, expand) for p in form.get("paths", [])]
            return _json([e for e in found if e is not None])
        if rest[0] == "commits" and req.method == "GET":
            return _json(self._history(repo_id, commit))
        return _error(404, None, "no such endpoint")

    def _resolve(self, req: Incoming, repo_id: str, rev: str, path: str) -> Reply:
        commit = self._find(req, repo_id, rev, is_file=True)
        if isinstance(commit, Reply):
            return commit
        blob = commit.files.get(path)
        if blob is None:
            return _error(404, "EntryNotFound", f"{path} does not exist on {rev}")
        headers = [("X-Repo-Commit", commit.sha)]
        if not blob.lfs:
            return serve_bytes(blob.data, f'"{blob.oid}"', req, headers)
        headers += [("X-Linked-Etag", f'"{blob.sha256}"'), ("X-Linked-Size", str(len(blob.data)))]
        if not self.redirect_lfs:
            return serve_bytes(blob.data, f'"{blob.sha256}"', req, headers)
        location = f"{self.url}/cdn-lfs/{blob.sha256}"
        return Reply(302, [*headers, ("ETag", f'"{blob.oid}"'), ("Location", location)])

    # -- answers -------------------------------------------------------------

    def _repo_info(self, repo_id: str, commit: Commit) -> dict[str, object]:
        repo = self.repos[repo_id]
        return {
            "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit.sha,
            "lastModified": DATE,
            "createdAt": DATE,
            "private": repo.token is not None and not repo.gated,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "siblings": [{"rfilename": name} for name in commit.files],
            **({"securityRepoStatus": self.scans[repo_id]} if repo_id in self.scans else {}),
        }

    def _last_commit(self, commit: Commit) -> dict[str, str]:
        return {"id": commit.sha, "title": commit.title, "date": DATE}

    def _entry(self, commit: Commit, path: str, expand: bool) -> dict[str, object] | None:
        path = path.strip("/")
        blob = commit.files.get(path)
        entry: dict[str, object]
        if blob is not None:
            entry = {"type": "file", "oid": blob.oid, "size": len(blob.data), "path": path}
            if blob.lfs:
                entry["lfs"] = {
                    "oid": blob.sha256,
                    "size": len(blob.data),
                    "pointerSize": len(blob.pointer),
                }
        elif path in commit.dirs():
            oid = hashlib.sha1(f"tree {commit.sha} {path}".encode()).hexdigest()
            entry = {"type": "directory", "oid": oid, "size": 0, "path": path}
        else:
            return None
        if expand:
            entry["lastCommit"] = self._last_commit(commit)
        return entry

    def _tree(self, req: Incoming, commit: Commit, path: str, expand: bool) -> Reply:
        path = path.strip("/")
        if path and path not in commit.dirs():
            return _error(404, "EntryNotFound", f"{path} does not exist")
        recursive = _flag(req.params.get("recursive", ["false"])[0])
        prefix = path + "/" if path else ""
        below = sorted(
            p
            for p in [*commit.dirs(), *commit.files]
            if p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :])
        )
        names = [p for p in below if p in commit.dirs()] + [p for p in below if p in commit.files]
        size = self.expand_page_size if expand else self.page_size
        start = int(req.params.get("cursor", ["0"])[0])
        page = [self._entry(commit, p, expand) for p in names[start : start + size]]
        headers = []
        if start + size < len(names):
            query = "&".join(f"{k}={quote(v[0])}" for k, v in req.params.items() if k != "cursor")
            nxt = f"{self.url}{req.raw_path}?{query}&cursor={start + size}"
            headers.append(("Link", f'<{nxt}>; rel="next"'))
        return _json(page, headers)

    def _history(self, repo_id: str, commit: Commit) -> list[dict[str, object]]:
        repo = self.repos[repo_id]
        out: list[dict[str, object]] = []
        current: Commit | None = commit
        while current is not None:
            out.append(
                {
                    **self._last_commit(current),
                    "message": "",
                    "authors": [{"user": "tester"}],
                }
            )
            current = repo.commits.get(current.parent) if current.parent else None
        return out


def _flag(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


def _json(obj: object, headers: list[tuple[str, str]] | None = None) -> Reply:
    body = json.dumps(obj).encode()
    return Reply(200, [("Content-Type", "application/json"), *(headers or [])], body)


def _error(status: int, code: str | None, message: str) -> Reply:
    headers = [("Content-Type", "application/json"), ("X-Error-Message", message)]
    if code is not None:
        headers.append(("X-Error-Code", code))
    return Reply(status, headers, json.dumps({"error": message}).encode())
