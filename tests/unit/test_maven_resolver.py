"""deploy/local/maven.py, the resolver that gives the local services Kafka's jars without Maven.

Against Maven Central itself: the runtime closure of ``kafka-clients`` is the set Maven's
``dependency:copy-dependencies -DincludeScope=runtime`` gives (checked when this test was written),
with no ``mvn`` on the PATH. Against a repository served here: a jar whose bytes do not match the
published ``.sha1`` is refused, and a verified cache needs no repository.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import ROOT

MAVEN = ROOT / "deploy" / "local" / "maven.py"
CACHE = Path(
    os.environ.get("HARVESTER_CACHE_DIR")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "outbox-harvester"
)


def resolve(
    into: Path, *artifacts: str, cache: Path, repository: str | None = None
) -> subprocess.CompletedProcess[str]:
    # No PATH at all: nothing but this Python can run (no mvn, no curl).
    env = {"HOME": str(Path.home()), "PATH": ""}
    if repository:
        env["MAVEN_REPOSITORY"] = repository
    return subprocess.run(
        [sys.executable, str(MAVEN), "--cache", str(cache), "--into", str(into), *artifacts],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def test_kafka_clients_closure_is_mavens(tmp_path: Path) -> None:
    # The project's shared repository cache: filled by services.sh's Kafka 4.1.1, else fetched now.
    done = resolve(tmp_path / "libs", "org.apache.kafka:kafka-clients:4.1.1", cache=CACHE / "maven")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "libs").iterdir()) == [
        "kafka-clients-4.1.1.jar",
        "lz4-java-1.8.0.jar",
        "slf4j-api-1.7.36.jar",
        "snappy-java-1.1.10.7.jar",
        "zstd-jni-1.5.6-10.jar",
    ]


@pytest.fixture
def repository(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A repository with Maven Central's layout on a loopback port: ``t:app:1`` depends on
    ``t:lib:1`` (compile), ``t:test-only:1`` (test) and ``t:gone:1`` (excluded through ``t:lib``)."""
    root = tmp_path / "repo"

    def publish(artifact: str, pom: str, jar: bytes | None = b"jar") -> None:
        folder = root / "t" / artifact / "1"
        folder.mkdir(parents=True)
        files = {f"{artifact}-1.pom": pom.encode()}
        if jar is not None:
            files[f"{artifact}-1.jar"] = jar + artifact.encode()
        for name, body in files.items():
            (folder / name).write_bytes(body)
            (folder / f"{name}.sha1").write_text(hashlib.sha1(body).hexdigest())

    def dep(artifact: str, extra: str = "") -> str:
        coordinate = f"<groupId>t</groupId><artifactId>{artifact}</artifactId><version>${{v}}</version>"
        return f"<dependency>{coordinate}{extra}</dependency>"

    head = "<project><modelVersion>4.0.0</modelVersion><groupId>t</groupId>"
    properties = "<properties><v>1</v></properties>"
    publish("parent", f"{head}<artifactId>parent</artifactId><version>1</version>{properties}</project>", None)
    parent = "<parent><groupId>t</groupId><artifactId>parent</artifactId><version>1</version></parent>"
    exclude = "<exclusions><exclusion><groupId>t</groupId><artifactId>gone</artifactId></exclusion></exclusions>"
    publish(
        "app",
        f"{head}{parent}<artifactId>app</artifactId><dependencies>{dep('lib', exclude)}"
        f"{dep('test-only', '<scope>test</scope>')}</dependencies></project>",
    )
    publish("lib", f"{head}{parent}<artifactId>lib</artifactId><dependencies>{dep('gone')}</dependencies></project>")
    publish("gone", f"{head}<artifactId>gone</artifactId><version>1</version></project>")
    publish("test-only", f"{head}<artifactId>test-only</artifactId><version>1</version></project>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()


def test_scopes_exclusions_parents_and_checksums(tmp_path: Path, repository: tuple[str, Path]) -> None:
    url, root = repository
    cache = tmp_path / "cache"
    done = resolve(tmp_path / "libs", "t:app:1", cache=cache, repository=url)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "libs").iterdir()) == ["app-1.jar", "lib-1.jar"]

    # Verified files are served from the cache: no repository needed.
    done = resolve(tmp_path / "again", "t:app:1", cache=cache, repository="http://127.0.0.1:9")
    assert done.returncode == 0, done.stderr

    # A jar altered after its checksum was published is refused, with the reason on one line.
    (root / "t" / "lib" / "1" / "lib-1.jar").write_bytes(b"tampered")
    done = resolve(tmp_path / "bad", "t:app:1", cache=tmp_path / "fresh", repository=url)
    assert done.returncode == 1
    assert "t/lib/1/lib-1.jar: SHA-1" in done.stderr and "does not match the published" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()
