"""Users' files (issue 32, data loss; issue 31, a re-run ``run_name``): a command writes only inside the folder
it was told to write, never deletes or replaces a file it did not write — not beside its output, not inside a
folder that holds no output of ours, not after a kill at any rename — and no name from a recipe points
outside the run's folder.

A kill is simulated in a forked child that SIGKILLs itself at its n-th ``os.replace`` / ``os.rename`` (every
rename the writers make goes through one of them): fast, and as abrupt as a real one (no ``finally`` runs)."""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.test_adapter_artifact import fresh_adapter, llama, probe_method  # noqa: F401  (fixtures)
from zoomkv.adapters.config import WEIGHTS_NAME
from zoomkv.adapters.model import ZoomAdapter
from zoomkv.cli import main, run_command
from zoomkv.errors import ConfigError
from zoomkv.train.config import load_recipe


def killed_at_rename(n: int, action: Callable[[], object]) -> bool:
    """Run ``action`` in a forked child that is SIGKILLed just before its ``n``-th rename; True when the kill
    came (False: ``action`` made fewer renames and finished)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            count = 0
            real_replace, real_rename = os.replace, os.rename

            def counted(real):
                def rename(*args, **kwargs):
                    nonlocal count
                    count += 1
                    if count == n:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args, **kwargs)
                return rename

            os.replace, os.rename = counted(real_replace), counted(real_rename)
            action()
        except BaseException:
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, f"the child failed before its rename {n}"
    return False


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# -- export: only folders zoomkv made are swept; only an adapter is replaced ------------------------------


def test_export_sweeps_only_working_folders_it_made(tmp_path, probe_method, llama, capsys):  # noqa: F811
    """Folders beside the output whose names merely look like export's working folders (``.NAME.old-N``,
    ``.NAME.partial-N``, any N) are the user's; an output name with glob characters globs nothing."""
    new = fresh_adapter(llama[0], seed=2).save_pretrained(tmp_path / "new")
    kx = tmp_path / "kx2"
    kx.mkdir()
    planted = [tmp_path / ".myadapter.old-2024", tmp_path / ".myadapter.partial-2025-x", kx / ".settings.old-backup",
               kx / ".settings.partial-77", kx / ".x.old-1"]
    for folder in planted:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    for out in (tmp_path / "myadapter", kx / "*", kx / "[a-z]*"):
        assert main(["export", str(new), "--out", str(out)]) == 0
        assert main(["export", str(new), "--out", str(out), "--overwrite"]) == 0
        for folder in planted:
            assert (folder / "notes.txt").read_text() == "mine", folder
    capsys.readouterr()
    assert sorted(p.name for p in kx.iterdir()) == sorted([".settings.old-backup", ".settings.partial-77",
                                                           ".x.old-1", "*", "[a-z]*"])


def test_overwrite_refuses_a_folder_that_is_not_an_adapter(tmp_path, probe_method, llama, capsys):  # noqa: F811
    new = fresh_adapter(llama[0], seed=2).save_pretrained(tmp_path / "new")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("my readme")
    (mine / "adapter_config.json").write_text('{"mine": true}')  # a config of something else
    for flags in ([], ["--overwrite"]):
        assert main(["export", str(new), "--out", str(mine), *flags]) == 2
        line = one_error_line(capsys)
        assert str(mine) in line and ("not an adapter" in line if flags else True), line
        assert (mine / "README.md").read_text() == "my readme"
        assert sorted(p.name for p in mine.iterdir()) == ["README.md", "adapter_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "new"]
    link = tmp_path / "link"  # a link to an adapter: the link is the user's, never replaced by a folder
    link.symlink_to(new)
    assert main(["export", str(new), "--out", str(link), "--overwrite"]) == 2
    assert "symbolic link" in one_error_line(capsys) and link.is_symlink()
    link.unlink()
    empty = tmp_path / "empty"  # an empty folder loses nothing: written into, with or without --overwrite
    empty.mkdir()
    assert main(["export", str(new), "--out", str(empty)]) == 0
    ZoomAdapter.from_pretrained(empty)


def test_a_kill_between_the_renames_loses_nothing(tmp_path, probe_method, llama, caplog):  # noqa: F811
    """Killed after the old adapter went aside and before the new one took its place: the output is missing.
    The next export puts the old folder (the user's file in it) back before anything else, then replaces it."""
    model = llama[0]
    out = fresh_adapter(model, seed=1).save_pretrained(tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    new = fresh_adapter(model, seed=2)
    assert killed_at_rename(2, lambda: new.save_pretrained(out, overwrite=True))
    assert not out.exists()  # the state a kill there leaves: the old folder is aside, the new one staged
    with caplog.at_level(logging.WARNING, logger="zoomkv"):
        new.save_pretrained(out, overwrite=True)
    assert "put " in caplog.text and "back" in caplog.text
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / WEIGHTS_NAME).read_bytes() == new.serialise()[WEIGHTS_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_kill_between_the_renames_then_a_new_folder_keeps_the_old_one(tmp_path, probe_method, llama,  # noqa: F811
                                                                         caplog):
    """When the output was made again before the next export (by the user), the folder left aside still holds
    a file the new one does not: it is kept, and a warning says where."""
    model = llama[0]
    out = fresh_adapter(model, seed=1).save_pretrained(tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    new = fresh_adapter(model, seed=2)
    assert killed_at_rename(2, lambda: new.save_pretrained(out, overwrite=True))
    out.mkdir()
    with caplog.at_level(logging.WARNING, logger="zoomkv"):
        new.save_pretrained(out)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
    assert len(kept) == 1 and (kept[0] / "out" / "notes.txt").read_text() == "mine"
    assert f"kept {kept[0] / 'out'}" in caplog.text and "notes.txt" in caplog.text
    ZoomAdapter.from_pretrained(out)


# -- train: names from a recipe stay in the run's folder; a run folder is new, empty or the run's own -------

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-llama-sekv.yaml"
FAST = ["num_samples=2", "queries_per_sample=3", "steps=2", "save_every=2", "layers_per_step=2", "--quiet"]


@pytest.mark.parametrize("name", ["../../victim", "", " ", "/abs/victim", "a/b", "..", ".", "a\\b"])
def test_run_name_is_one_plain_folder_name(name, tmp_path):
    with pytest.raises(ConfigError, match="recipe key 'run_name'"):
        load_recipe(TINY, [f"output_dir={tmp_path}", f"run_name={name}"])


@pytest.mark.parametrize("cache", ["/tmp/elsewhere", "../up", "a/../../b", "~/cache"])
def test_a_recipe_file_keeps_the_teacher_cache_below_the_working_folder(cache, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(TINY.read_text() + f"teacher_cache: {cache!r}\n")
    with pytest.raises(ConfigError, match="recipe key 'teacher_cache'.*command line"):
        load_recipe(recipe)
    assert load_recipe(TINY, [f"teacher_cache={tmp_path / 'mine'}"]).teacher_cache == str(tmp_path / "mine")


def test_recipe_names_steer_no_write_into_a_users_folder(tmp_path, monkeypatch, capsys):
    """``run_name=../../victim``, an empty ``run_name`` and ``teacher_cache=`` a user's folder: one line, exit 2,
    before the model loads, and the user's report.json / train_config.yaml / meta.json are as they were."""
    import zoomkv.models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(zoomkv.models, "load_model", no_model)
    victim = tmp_path / "victim"
    victim.mkdir()
    mine = {"report.json": "mine", "train_config.yaml": "mine: 1\n", "meta.json": '{"mine": 1}', "notes.txt": "x"}
    for name, text in mine.items():
        (victim / name).write_text(text)
    runs = tmp_path / "a" / "b"
    cases = [[f"output_dir={runs}", "run_name=../../victim"], [f"output_dir={victim}", "run_name="],
             [f"output_dir={tmp_path / 'runs'}", f"teacher_cache={victim}"],
             [f"output_dir={tmp_path}", "run_name=victim"]]  # a folder of other files is no run folder
    for case in cases:
        assert run_command("train", ["--recipe", str(TINY), *case, *FAST], prog="train") == 2, case
        line = one_error_line(capsys)
        assert "run_name" in line or "teacher_cache" in line or "no zoomkv run" in line, line
        assert {p.name: p.read_text() for p in victim.iterdir()} == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]


def _train(tmp: Path, *extra: str) -> int:
    return run_command("train", ["--recipe", str(TINY), f"output_dir={tmp / 'runs'}",
                                 f"teacher_cache={tmp / 'teacher'}", *FAST, *extra], prog="train")


def test_a_run_name_run_again_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    """Issue 31: a second run of the same run_name without ``resume`` trained into the first one's folder (its
    steps 2-6 overwritten, its step 8 left for a later ``resume=latest``). Now it is one line unless resumed or
    ``overwrite=true``, which removes only the earlier run's checkpoints and adapter."""
    assert _train(tmp_path, "steps=4") == 0
    run = tmp_path / "runs" / "sekv-tiny"
    steps = run / "checkpoints"
    assert sorted(p.name for p in steps.iterdir()) == ["step_000002", "step_000004"]
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    (run / "notes.txt").write_text("mine")  # the user's, beside and inside the run's folders
    (steps / "step_000003").mkdir()
    (steps / "step_000003" / "plan.txt").write_text("mine")
    capsys.readouterr()
    assert _train(tmp_path) == 2
    line = one_error_line(capsys)
    assert "already holds a run (checkpoints up to step 4 and an adapter)" in line and "overwrite=true" in line
    assert {p: p.read_bytes() for p in before} == before  # nothing of the earlier run touched
    assert _train(tmp_path, "overwrite=true", "resume=latest") == 2
    assert "give one" in one_error_line(capsys)
    assert _train(tmp_path, "overwrite=true") == 0
    assert sorted(p.name for p in steps.iterdir()) == ["step_000002", "step_000003"]  # step 4 of the old run: gone
    assert (run / "notes.txt").read_text() == "mine" and (steps / "step_000003" / "plan.txt").read_text() == "mine"
    from zoomkv.train.checkpoints import latest_checkpoint

    assert latest_checkpoint(run).name == "step_000002"
    assert _train(tmp_path, "steps=4", "resume=latest") == 0  # resuming is what it always was


# -- eval: --out is new, empty or an eval run's; --overwrite deletes only what eval wrote --------------------


def _eval_cfg(out: Path, **kw):
    from zoomkv.eval.harness import EvalConfig

    base = dict(model="tiny-llama", out=out, methods=["streamingllm"], budgets=["64"], tasks=["niah_single_1"],
                lengths=[600], samples=1, max_new_tokens=2, progress=False, plots=True)
    return EvalConfig(**{**base, **kw})


def test_eval_writes_into_no_folder_of_other_files(tmp_path, tiny, capsys):
    from zoomkv.eval.harness import run_eval

    mine = tmp_path / "mine"
    mine.mkdir()
    planted = {"summary.md": "my summary", "rows.csv": "a,b\n", "notes.txt": "x"}
    for name, text in planted.items():
        (mine / name).write_text(text)
    args = ["eval", "--model", "tiny-llama", "--methods", "streamingllm", "--budgets", "64", "--length", "600",
            "--samples", "1", "--max-new-tokens", "2", "--out", str(mine), "--quiet"]
    for flags in ([], ["--overwrite"], ["--report-only"]):
        assert main([*args, *flags]) == 2
        line = one_error_line(capsys)
        assert str(mine) in line and any(w in line for w in ("no zoomkv eval run", "no rows")), line
        assert {p.name: p.read_text() for p in mine.iterdir()} == planted
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_eval(_eval_cfg(empty), *tiny)


def test_eval_overwrite_deletes_only_the_files_it_wrote(tmp_path, tiny, capsys):
    from zoomkv.errors import ZoomKVError
    from zoomkv.eval.harness import run_eval

    out = tmp_path / "run"
    run_eval(_eval_cfg(out), *tiny)
    ours = {p.name for p in out.iterdir()}
    assert {"rows.jsonl", "summary.md", "pareto.png", "run.json"} <= ours
    (out / "photo.png").write_bytes(b"mine")  # the user's, of no name eval writes: kept by everything
    run_eval(_eval_cfg(out, overwrite=True), *tiny)
    assert (out / "photo.png").read_bytes() == b"mine"
    (out / "score_vs_budget_mine.png").write_bytes(b"mine")  # of a name eval writes, but not written by it
    for kw in ({}, {"overwrite": True}, {"report_only": True}):
        with pytest.raises(ZoomKVError, match="score_vs_budget_mine.png was not written by zoomkv eval"):
            run_eval(_eval_cfg(out, **kw), *tiny)
        assert (out / "score_vs_budget_mine.png").read_bytes() == b"mine"
    (out / "score_vs_budget_mine.png").unlink()
    run_eval(_eval_cfg(out, budgets=["32"], overwrite=True), *tiny)
    assert {p.name for p in out.iterdir()} == ours | {"photo.png"}


def test_report_only_on_rows_put_together(tmp_path, tiny):
    """README: several runs' rows.jsonl put together in one folder, then --report-only: a folder of our rows
    alone is reported (and becomes a run of ours), a summary of the user's there is refused."""
    from zoomkv.errors import ZoomKVError
    from zoomkv.eval.harness import run_eval

    run_eval(_eval_cfg(tmp_path / "a"), *tiny)
    together = tmp_path / "together"
    together.mkdir()
    (together / "rows.jsonl").write_bytes((tmp_path / "a" / "rows.jsonl").read_bytes())
    (together / "summary.md").write_text("mine")
    with pytest.raises(ZoomKVError, match="summary.md was not written"):
        run_eval(_eval_cfg(together, report_only=True), *tiny)
    (together / "summary.md").unlink()
    run_eval(_eval_cfg(together, report_only=True), *tiny)
    run_eval(_eval_cfg(together, report_only=True), *tiny)  # again: its own report is replaced
    assert "streamingllm" in (together / "summary.md").read_text()


def test_a_report_killed_midway_leaves_its_files_claimed(tmp_path, tiny, monkeypatch):
    """A kill while the report is written: the next run finds files of the report's names that run.json did
    not list yet, and takes them as its own (run.json said a report was being written)."""
    import zoomkv.eval.report as report
    from zoomkv.eval.harness import run_eval

    out = tmp_path / "run"
    run_eval(_eval_cfg(out, plots=False), *tiny)
    real = report.write_summary

    def killed(rows, out_, *args, **kwargs):
        real(rows, out_, *args, **kwargs)
        (Path(out_) / "pareto.png").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "write_summary", killed)
    with pytest.raises(KeyboardInterrupt):
        run_eval(_eval_cfg(out), *tiny)
    monkeypatch.setattr(report, "write_summary", real)
    run_eval(_eval_cfg(out), *tiny)
    assert (out / "pareto.png").stat().st_size > 1000


# -- calibrate: a profile path is new or a profile; its temporary file never has a user's name -------------


def test_calibrate_replaces_a_profile_and_never_another_file(tmp_path, monkeypatch, capsys):
    import zoomkv.models

    mine = tmp_path / "p.json"
    mine.write_text('{"mine": 1}')
    (tmp_path / "p.json.tmp").write_text("mine too")  # the name the temporary file used to have
    (tmp_path / "p.safetensors").write_text("not a profile")
    real_load = zoomkv.models.load_model
    monkeypatch.setattr(zoomkv.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    for argv in (["compresskv", "--samples", "1", "--length", "300", "--accept-all", "--out", str(mine)],
                 ["infinigen", "--tokens", "64", "--output", str(tmp_path / "p.safetensors")]):
        assert main(["calibrate", argv[0], "--model", "tiny-llama", *argv[1:]]) == 2
        assert "is never replaced" in one_error_line(capsys)
    monkeypatch.setattr(zoomkv.models, "load_model", real_load)
    mine.unlink()
    for _ in range(2):  # a new path, then the profile written there: replaced
        assert main(["calibrate", "compresskv", "--model", "tiny-llama", "--samples", "1", "--length", "300",
                     "--accept-all", "--out", str(mine), "--quiet"]) == 0
        assert main(["calibrate", "infinigen", "--model", "tiny-llama", "--tokens", "64", "--quiet",
                     "--output", str(tmp_path / "i.safetensors")]) == 0
    capsys.readouterr()
    assert (tmp_path / "p.json.tmp").read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i.safetensors", "p.json", "p.json.tmp", "p.safetensors"]


# -- must show: user files beside and inside every output folder survive every command, --overwrite and a kill
# -- at every rename ------------------------------------------------------------------------------------------


def plant(folder: Path, parent_name: str | None = None) -> dict[Path, bytes]:
    """A user's files in ``folder``: a note, a nested one, and, when ``parent_name`` names an output folder
    beside them, folders whose names look like that output's working folders (one even holding a copy of a
    real working folder's mark, which names another folder)."""
    files = {folder / "notes.txt": b"mine", folder / "mine" / "deep.txt": b"mine too"}
    if parent_name is not None:
        files[folder / f"{parent_name}.tmp"] = b"mine"
        for look in (f".{parent_name}.old-2024", f".{parent_name}.partial-1", f".{parent_name}.old-999999-x"):
            files[folder / look / "notes.txt"] = b"mine"
        files[folder / f".{parent_name}.old-999998-y" / ".zoomkv-owned"] = \
            f"zoomkv working folder .{parent_name}.old-999999-x\n".encode()
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def assert_kept(planted: dict[Path, bytes], *, killed: bool = False) -> None:
    """Every planted file is where it was, as it was. Right after a kill (``killed``) one may instead be in the
    folder a replace had moved aside (the next run puts it back): under its output's name, inside a marked
    ``.NAME.old-*`` folder beside that output."""
    for path, data in planted.items():
        if path.is_file() and path.read_bytes() == data:
            continue
        assert killed, path
        asides = [a for parent in path.parents for a in parent.parent.glob(f".{parent.name}.old-*")
                  if (a / parent.name / path.relative_to(parent)).is_file()
                  and (a / parent.name / path.relative_to(parent)).read_bytes() == data]
        assert asides, path


def survive(planted: dict[Path, bytes], commands: list[Callable[[], object]], killed: Callable[[], object],
            recover: Callable[[], object]) -> int:
    """Run each command (the user's files after each), then ``killed`` with a kill before its 1st, 2nd, ...
    rename until it finishes unkilled, each kill followed by ``recover``; returns how many kills there were."""
    for command in commands:
        command()
        assert_kept(planted)
    n = 1
    while killed_at_rename(n, killed):
        assert_kept(planted, killed=True)
        recover()
        assert_kept(planted)
        n += 1
    assert n > 1, "the command made no rename"
    return n - 1


def test_export_keeps_every_user_file(tmp_path, probe_method, llama, capsys):  # noqa: F811
    from zoomkv.adapters.checkpoint import write_checkpoint

    adapter = fresh_adapter(llama[0])
    c = adapter.config
    ckpt = write_checkpoint(tmp_path / "ckpt" / "step_10", adapter.modules, method=c.method, hyper=c.hyper,
                            base_model=c.base_model, shape=c.model_shape())
    out = tmp_path / "out" / "adapter"
    planted = plant(tmp_path / "out", "adapter")
    export = ["export", str(ckpt), "--out", str(out)]
    assert main(export) == 0
    planted |= plant(out)

    def run(*flags: str, code: int = 0) -> None:
        assert main([*export, *flags]) == code
        capsys.readouterr()

    kills = survive(planted, [lambda: run(code=2), lambda: run("--overwrite")],
                    killed=lambda: run("--overwrite"), recover=lambda: run("--overwrite"))
    assert kills == 2  # the old folder aside, the new one in place
    ZoomAdapter.from_pretrained(out)


def test_train_keeps_every_user_file(tmp_path, capsys):
    runs, teacher = tmp_path / "runs", tmp_path / "teacher"
    planted = plant(tmp_path, "teacher") | plant(runs, "sekv-tiny")
    base = ["--recipe", str(TINY), f"output_dir={runs}", f"teacher_cache={teacher}", *FAST]

    def train(*extra: str, code: int = 0) -> None:
        got = run_command("train", [*base, *extra], prog="train")
        assert got == code, capsys.readouterr().err
        capsys.readouterr()

    train()
    run = runs / "sekv-tiny"
    planted |= plant(run) | plant(run / "checkpoints", "step_000002") | plant(run / "adapter") | plant(teacher)
    planted |= plant(run / "checkpoints" / "step_000002")
    kills = survive(planted, [lambda: train(code=2), lambda: train("overwrite=true"),
                              lambda: train("resume=latest")],
                    killed=lambda: train("overwrite=true", "num_samples=3"),  # the teacher cache rewritten too
                    recover=lambda: train("overwrite=true", "num_samples=3"))
    assert kills >= 3
    ZoomAdapter.from_pretrained(run / "adapter")


def test_eval_keeps_every_user_file(tmp_path, capsys):
    out = tmp_path / "ev" / "run"
    planted = plant(tmp_path / "ev", "run")
    args = ["eval", "--model", "tiny-llama", "--methods", "streamingllm", "--budgets", "64", "--length", "600",
            "--samples", "1", "--max-new-tokens", "2", "--out", str(out), "--quiet"]

    def run(*flags: str) -> None:
        assert main([*args, *flags]) == 0
        capsys.readouterr()

    run()
    planted |= plant(out)
    (out / "photo.png").write_bytes(b"mine")
    planted[out / "photo.png"] = b"mine"
    kills = survive(planted, [run, lambda: run("--overwrite"), lambda: run("--report-only")],
                    killed=lambda: run("--overwrite"), recover=run)
    assert kills >= 2
    assert "streamingllm" in (out / "summary.md").read_text()


def test_calibrate_keeps_every_user_file(tmp_path, capsys):
    out = tmp_path / "cal" / "p.json"
    planted = plant(tmp_path / "cal", "p.json")
    args = ["calibrate", "compresskv", "--model", "tiny-llama", "--samples", "1", "--length", "300",
            "--accept-all", "--out", str(out), "--quiet"]

    def run() -> None:
        assert main(args) == 0
        capsys.readouterr()

    assert survive(planted, [run, run], killed=run, recover=run) == 1
    assert json.loads(out.read_text())["format"] == "zoomkv-compresskv-profile"


def test_push_staging_keeps_every_user_file(tmp_path, probe_method, llama, monkeypatch):  # noqa: F811
    """``ZoomAdapter.push_to_hub`` stages the folder it uploads in a new temporary folder of its own."""
    import tempfile

    import zoomkv.adapters.model as model_module

    pushed: list[list[str]] = []
    monkeypatch.setattr(model_module, "push_folder",
                        lambda folder, repo_id, **kw: pushed.append(sorted(p.name for p in Path(folder).iterdir())))
    staging_root = tmp_path / "tmp"
    staging_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging_root))
    planted = plant(staging_root, "zoomkv-push-abc")
    adapter = fresh_adapter(llama[0])
    push = lambda: adapter.push_to_hub("user/probe")  # noqa: E731
    assert survive(planted, [push, push], killed=push, recover=push) == 1
    assert pushed[0] == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
