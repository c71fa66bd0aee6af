"""Driving SGLang (--sglang-url) without SGLang installed: ``plan``, the client and the drive against a small HTTP
server answering as SGLang 0.5.23's routes do, and a node process pointed at an SGLang that is not there.

SGLang's own code driven by a real node is tests/integrations/test_sglang.py (scripts/test_sglang).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from adapter_fabric.errors import InvalidArgument, PeerUnavailable
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.integrations.engine_models import EngineLoRA
from adapter_fabric.integrations.sglang import Plan, SGLangClient, plan
from adapter_fabric.node.engine_drive import SGLangDrive
from adapter_fabric.node.engines import EngineViews
from adapter_fabric.store.manifest import CONFIG_FILE, WEIGHTS_FILE
from tests.node.test_startup import one_line_failure, run_node, store_only
from tests.support.fake_engines import FakeSGLang
from tests.support.waiting import wait_for

EXPORT = "/x/export"


# ---------------------------------------------------------------- plan: pure


def card(name: str, root: str) -> EngineLoRA:
    return EngineLoRA(name=name, root=root)


def test_plan_loads_what_is_held_and_not_loaded_and_unloads_ours_no_longer_held() -> None:
    held = {"a": f"{EXPORT}/a", "b": f"{EXPORT}/b"}
    loaded = [card("a", f"{EXPORT}/a"), card("gone", f"{EXPORT}/gone"), card("mine", "/opt/loras/mine")]
    assert plan(held, loaded, EXPORT) == Plan(loads=(("b", f"{EXPORT}/b"),), unloads=("gone",))


def test_plan_of_a_restarted_sglang_loads_everything_and_of_a_restarted_node_nothing_twice() -> None:
    held = {"a": f"{EXPORT}/a", "b": f"{EXPORT}/b"}
    assert plan(held, [], EXPORT).loads == (("a", f"{EXPORT}/a"), ("b", f"{EXPORT}/b"))
    assert not plan(held, [card("a", f"{EXPORT}/a/"), card("b", f"{EXPORT}/b")], EXPORT)  # trailing slash: the same path


def test_plan_leaves_a_name_sglang_uses_for_another_path_alone_and_says_so() -> None:
    todo = plan({"a": f"{EXPORT}/a"}, [card("a", "/elsewhere/a")], EXPORT)
    assert todo == Plan(conflicts=("a",)) and not todo


def test_plan_keeps_a_held_path_loaded_by_hand_under_another_name() -> None:
    todo = plan({"a": f"{EXPORT}/a"}, [card("support", f"{EXPORT}/a")], EXPORT)
    assert todo.unloads == () and todo.loads == (("a", f"{EXPORT}/a"),)


def test_plan_reloads_a_held_adapter_whose_bytes_changed() -> None:
    todo = plan({"a": f"{EXPORT}/a"}, [card("a", f"{EXPORT}/a")], EXPORT, changed=frozenset({"a"}))
    assert todo == Plan(loads=(("a", f"{EXPORT}/a"),), unloads=("a",))


# ---------------------------------------------------------------- a server answering as SGLang does (tests/support/fake_engines.py)


@pytest.fixture
def sglang():
    fake = FakeSGLang()
    yield fake
    fake.close()


def exported(root: Path, *names: str) -> Path:
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / CONFIG_FILE).write_text("{}")
        (root / name / WEIGHTS_FILE).write_bytes(b"w")
    return root


def drive_of(url: str, export: Path) -> SGLangDrive:
    """A drive of the SGLang at ``url`` over ``export``, with the engine view a node gives it."""
    return SGLangDrive(SGLangClient(url, timeout=5), EngineViews((), str(export), driven=(url,)), str(export), 10)


def test_the_client_loads_unloads_and_lists_and_names_the_engine_in_every_failure(sglang, tmp_path) -> None:
    export = exported(tmp_path / "export", "a")
    client = SGLangClient(sglang.url, timeout=5)
    assert client.load("a", str(export / "a")) is True
    assert client.load("a", str(export / "a")) is False  # 400 "already loaded": done already
    assert client.loaded().adapters == (EngineLoRA("a", str(export / "a")),)
    assert client.unload("a") is True and client.unload("a") is False  # 400 "does not exist"
    with pytest.raises(InvalidArgument, match=rf"engine 127.0.0.1:\d+ refused to load 'b' .*Repository Not Found"):
        client.load("b", str(export / "b"))  # not a directory: SGLang takes it as a hub id
    silent = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(PeerUnavailable, match=r"engine 127.0.0.1:\d+ did not answer POST /load_lora_adapter"):
        silent.load("a", str(export / "a"))


def test_the_drive_loads_the_export_dir_unloads_what_went_and_leaves_others_alone(sglang, tmp_path) -> None:
    export = exported(tmp_path / "export", "team-a%2Fone", "team-a%2Ftwo")
    (export / "%old-1-ab").mkdir()  # set aside: never loaded
    sglang.loaded["operator"] = "/opt/loras/operator"
    drive = drive_of(sglang.url, export)
    drive.reconcile()
    assert sglang.loaded == {"operator": "/opt/loras/operator", "team-a%2Fone": str(export / "team-a%2Fone"), "team-a%2Ftwo": str(export / "team-a%2Ftwo")}
    views = drive.views
    views.read(sglang.url)  # as the drive's next round reads it
    assert views.engines_of("team-a/one") == [views.engines[0].label] and views.hold(["team-a/one"]) == ""  # shown, not holding

    for path in (export / "team-a%2Ftwo").iterdir():
        path.unlink()
    (export / "team-a%2Ftwo").rmdir()  # unstaged
    drive.reconcile()
    assert set(sglang.loaded) == {"operator", "team-a%2Fone"}

    sglang.loaded.clear()  # SGLang restarted: none loaded
    drive.reconcile()
    assert set(sglang.loaded) == {"team-a%2Fone"}
    sglang.calls.clear()
    drive_of(sglang.url, export).reconcile()  # the node restarted
    assert sglang.calls == []  # in step already: nothing loaded twice


def test_a_re_staged_adapter_is_loaded_again(sglang, tmp_path) -> None:
    export = exported(tmp_path / "export", "a")
    drive = drive_of(sglang.url, export)
    drive.reconcile()
    (tmp_path / "new").write_bytes(b"new")
    (tmp_path / "new").replace(export / "a" / WEIGHTS_FILE)  # another file, as a re-stage's hard link is
    sglang.calls.clear()
    drive.reconcile()
    assert sglang.calls == [("/unload_lora_adapter", "a"), ("/load_lora_adapter", "a")]


def test_release_unloads_victims_first_and_names_the_engine_for_one_it_would_not(sglang, tmp_path) -> None:
    export = exported(tmp_path / "export", "one", "two", "three")
    drive = drive_of(sglang.url, export)
    drive.reconcile()
    sglang.refuse_unload.add("two")
    with drive.paused():
        refused = drive.release(["one", "two"])
    label = sglang.url.removeprefix("http://")
    assert refused == {"two": f"loaded in engine {label}, which did not unload it"}
    assert set(sglang.loaded) == {"two", "three"}
    silent = drive_of(f"http://127.0.0.1:{free_port()}", export)
    assert set(silent.release(["three", "gone"])) == {"three"}  # not answering: what is still exported is held


# ---------------------------------------------------------------- the node


@pytest.mark.slow
def test_a_node_driving_an_unreachable_sglang_keeps_serving_and_logs_the_failure_by_name(tmp_path, store_adapters) -> None:
    port = free_port()
    node = LocalNode(
        tmp_path / "node", model="none",
        extra_args=["--export-dir", str(tmp_path / "export"), "--sglang-url", f"http://127.0.0.1:{port}", "--sglang-sync-interval", "1s"],
    ).start()  # fmt: skip
    try:
        with node.client() as client:
            client.stage(store_adapters["a"], "team-a/one")
            assert [a.adapter_id for a in client.list().staged] == ["team-a/one"]
        deadline = time.monotonic() + 20
        while "SGLang not answering" not in node.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        lines = [line for line in node.log_path.read_text().splitlines() if "SGLang not answering" in line]
        assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], lines  # once per change of state, naming the engine
        assert "Traceback" not in node.log_path.read_text()
    finally:
        assert node.stop() == 0


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--sglang-url", "ftp://127.0.0.1:30000"], ["--sglang-url", "not an http:// or https:// URL"]),
        (["--sglang-url", "http://127.0.0.1:30000/?x=1"], ["--sglang-url", "query or fragment"]),
        (["--sglang-url", "http://127.0.0.1:30000"], ["--sglang-url needs --export-dir"]),
        (["--sglang-sync-interval", "0.5s"], ["--sglang-sync-interval", "from 1s to 1h"]),
        (["--sglang-sync-interval", "2h"], ["--sglang-sync-interval", "from 1s to 1h"]),
    ],
)
def test_bad_sglang_flags_are_one_line_with_status_2(tmp_path, args, needles) -> None:
    one_line_failure(run_node(store_only(tmp_path, *args)), *needles, code=2)
    assert not (tmp_path / "store").exists()  # refused before the store was touched


def test_a_bad_sglang_variable_is_one_line_naming_it(tmp_path) -> None:
    done = run_node(store_only(tmp_path, "--export-dir", str(tmp_path / "export")), env={"FABRIC_SGLANG_URL": "localhost:30000"})
    one_line_failure(done, "FABRIC_SGLANG_URL", "http://", code=2)


@pytest.mark.slow
def test_a_node_unloads_and_reloads_into_sglang_an_id_that_moved_at_its_origin(sglang, tmp_path, store_adapters) -> None:
    """A real node with a file:// origin and --origin-ttl 0: the origin's new bytes move the id to a new digest, and the
    driven SGLang is made to unload the old weights and load the new ones under the same name, right after the move."""
    import shutil

    origin = tmp_path / "origin" / "team-a" / "support"
    shutil.copytree(store_adapters["a"], origin)
    node = LocalNode(
        tmp_path / "node", model="none", port=free_port(),
        extra_args=["--export-dir", str(tmp_path / "export"), "--sglang-url", sglang.url, "--sglang-sync-interval", "1h",
                    "--origin", f"file://{tmp_path / 'origin'}", "--origin-ttl", "0"],
    ).start()  # fmt: skip
    name = "team-a%2Fsupport"
    try:
        with node.client() as client:
            first = client.pull("team-a/support")
            wait_for(lambda: name in sglang.loaded, "SGLang to load the fetched adapter")  # exported: the drive loads it at once, not at its 1h tick
            sglang.calls.clear()
            for file in (CONFIG_FILE, WEIGHTS_FILE):  # retrained at the origin
                (origin / file).unlink()
                shutil.copyfile(store_adapters["b"] / file, origin / file)
            moved = client.pull("team-a/support")
        assert moved.digest != first.digest
        # the fake records a call as it arrives and applies it after: wait for both
        wait_for(lambda: sglang.calls == [("/unload_lora_adapter", name), ("/load_lora_adapter", name)] and name in sglang.loaded,
                 "SGLang to unload and load the moved id")
        assert sglang.loaded == {name: str(tmp_path / "export" / name)}
    finally:
        node.stop()

