"""The crash campaign's small version, in CI: ``compresskit apply`` killed with SIGKILL at one crash point of
each kind (the resume marker's write, a cache write, a checkpoint's write, the model's save, the
evaluation, the results' write, the final move), over another run (between the two renames that replace it),
at a random moment, and twice in a row; each rerun must end whole and equal to an uninterrupted run. The
full campaign is ``make crash-campaign`` (``tests/crash/crash_campaign.py``)."""

import crash_campaign as cc
import pytest

pytestmark = pytest.mark.slow  # (about 4 minutes on 2 cores: each run is a process of its own)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return cc.prepare(tmp_path_factory.mktemp("crash"), None, [])


def test_the_uninterrupted_run_is_deterministic_and_passes_every_kind_of_point(setup):
    """(What the campaign's equality rests on, and the points it kills at.)"""
    assert setup.deterministic
    points = setup.points["fresh"]
    kinds = ("write mb", "router step", "write checkpoint.pt (the lora", "save model/", "stage model:", "evaluation:")
    for kind in kinds:
        assert any(p.startswith(kind) for p in points), kind
    assert points[-3:] == [
        "publish: the checkpoints removed",
        "publish: the resume marker removed",
        "publish: moved into place",
    ]
    assert any(p.startswith("replace run:") for p in setup.points["overwrite"])


def first(points: list[str], prefix: str, after: int = 0) -> int:
    """The 1-based index of the first point after ``after`` that starts with ``prefix``."""
    return next(i for i, p in enumerate(points, 1) if i > after and p.startswith(prefix))


def test_every_kill_leaves_a_whole_folder_and_every_rerun_an_equal_run(setup):
    fresh, over = setup.points["fresh"], setup.points["overwrite"]
    saved = first(fresh, "stage model:")
    picks = [
        first(fresh, "write recipe.json"),  # the resume marker's write
        first(fresh, "write mb"),  # the teacher's cached logits
        first(fresh, "write checkpoint.pt (the lora"),
        first(fresh, "save model/"),
        saved,
        first(fresh, "evaluation:", after=saved),
        first(fresh, "write results.json"),
        first(fresh, "publish: the resume marker removed"),
    ]
    cases = [cc.Case("fresh", at=k, label=f"point {k}: {fresh[k - 1]}") for k in picks]
    k = first(over, "replace run:")
    cases.append(cc.Case("overwrite", at=k, label=f"point {k}: {over[k - 1]}"))
    cases.append(cc.Case("fresh", after_s=round(setup.seconds / 2, 1), label="half way"))
    cases.append(cc.Case("fresh", at=saved - 1, again_at=3, label="twice"))
    done = cc.campaign(setup, cases, jobs=1, report=lambda line: None)
    failed = [f"{c.label}: {'; '.join(c.problems)}" for c in done if not c.ok]
    assert failed == []
    said = {c.label.split(": ", 1)[-1]: c for c in done}
    assert "moved into place" in said["publish: the resume marker removed"].rerun  # everything written: no redo
    lora = "write checkpoint.pt (the lora stage's checkpoint at step 4): the temporary file whole, not renamed"
    assert "resumed" in said[lora].rerun  # from the router stage's last checkpoint
    between = said["replace run: the old folder set aside, the new one not yet moved"]
    assert between.left == "staging with a model" and "moved into place" in between.rerun
