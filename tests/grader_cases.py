"""One scoring case per preset reward rule, each needing the grader package its rule imports, and the runner that
scores them here or inside a stage image.

Every case is a finished trajectory scored by `loupe.rewards.score_trajectory` with a preset's own reward settings
(`params/<preset>.yaml`, section `section`, read as `loupe run` reads them), so it goes through the preset's reward
path as the rl stage's RewardPool or the eval stage would. `graders` names the packages the case's score needs
(without any one of them it fails or changes; the fast test checks that). An LLM judge's cases answer from
`tests/fake_openai.py`'s server on loopback, which the runner starts: the judge's `openai` client really runs.
Which image scores a section: the rl image every RL-shaped section (`pipeline.rl_sections`: rl, LMM-R1's rl_fre,
ttrl), the eval image `eval`, the synth image `synth` (`scoring_sections`).

    python tests/grader_cases.py PAYLOAD.json      # here or in an image, with the repository as working directory

scores each case of the payload (`payload()`) in a child forked from a process that has imported `loupe.rewards`
and nothing else of the reward path, and prints one JSON line per case: its parts, and the distributions of the
third-party modules scoring it imported (`distributions`; the baseline's included), which the fast test
(tests/test_containers.py) checks against each image's lock. A case may list modules to block (`blocked`): the
child then scores with those imports failing. The runner needs only the standard library and loupe, so it runs
in any image; the helpers that build payloads read the params files with `pipelines` (on the host).
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class GraderCase:
    id: str
    preset: str
    section: str
    solution: str
    turns: tuple[tuple[str, str], ...]
    """(role, text) after the question: the assistant's turns and what was given back."""
    answer: str | None
    total: float
    accuracy: float
    graders: tuple[str, ...]
    why: str
    data_source: str = "unknown"
    num_tool_calls: int = 0
    judge_reply: str | None = None
    """What the fake judge answers; None: no judge in this case's reward path."""
    end_reason: str = "answered"


CROP = (("assistant", ('<think>The sign is too small to read; zoom in.</think>\n<tool_call>{"name": '
                       '"image_zoom_in_tool", "arguments": {"bbox_2d": [10, 10, 200, 120]}}</tool_call>')),
        ("user", "<tool_response>\n<image>\n</tool_response>"))
"""A crop asked for and given back (DeepEyes' tool-response template): the case's response holds one image."""

CASES: tuple[GraderCase, ...] = (
    GraderCase("r1v_sentence_holding_the_number", "r1-v", "rl", "<answer> 3 </answer>",
               (("assistant", "<think>Two cubes, one sphere.</think><answer>There are 3 objects.</answer>"),),
               "There are 3 objects.", total=2.0, accuracy=1.0, graders=("math-verify", "latex2sympy2-extended"),
               why="R1-V's accuracy: math-verify reads 3 in the completion (its string fallback compares "
                   "'There are 3 objects.' with '3' and fails); format 1 (think then answer), weight 1 each"),
    GraderCase("r1v_eval_by_value", "r1-v", "eval", "0.5",
               (("assistant", "<think>Half.</think><answer>\\frac{1}{2}</answer>"),), "\\frac{1}{2}",
               total=1.0, accuracy=1.0, graders=("math-verify", "latex2sympy2-extended"),
               why="eval's `math`: equal by value through math-verify, not by spelling"),
    GraderCase("lmm_r1_boxed_fraction", "lmm-r1", "rl", "0.5",
               (("assistant", "<think>Half of one.</think><answer>$\\boxed{\\frac{1}{2}}$</answer>"),), None,
               total=1.5, accuracy=1.0, graders=("math-verify", "latex2sympy2-extended"),
               why="LMM-R1's verify_math: the boxed 1/2 equals $0.5$ by math-verify (latex2sympy2_extended's "
                   "NormalizationConfig); format 1 x 0.5"),
    GraderCase("lmm_r1_fre_boxed_fraction", "lmm-r1", "rl_fre", "0.5",
               (("assistant", "<think>Half of one.</think><answer>$\\boxed{\\frac{1}{2}}$</answer>"),), None,
               total=1.5, accuracy=1.0, graders=("math-verify", "latex2sympy2-extended"),
               why="the FRE stage's reward is LMM-R1's rule too (scored by the rl image)"),
    GraderCase("lmm_r1_eval_radical", "lmm-r1", "eval", "2\\sqrt{3}",
               (("assistant", "<think>sqrt 12.</think><answer>\\sqrt{12}</answer>"),), "\\sqrt{12}",
               total=1.0, accuracy=1.0, graders=("math-verify", "latex2sympy2-extended"),
               why="eval's `math`: sqrt(12) = 2 sqrt(3) by value"),
    GraderCase("easyr1_boxed_fraction_for_decimal", "easyr1-geo", "rl", "0.5",
               (("assistant", "<think>The ratio is one half.</think> The answer is \\boxed{\\frac{1}{2}}."),), None,
               total=1.0, accuracy=1.0, graders=("mathruler", "pylatexenc"),
               why="EasyR1's math reward: MathRuler's grade_answer finds \\frac{1}{2} equal to 0.5 (its LaTeX read "
                   "by pylatexenc, compared by sympy); 0.9 x 1 + 0.1 x format 1"),
    GraderCase("easyr1_eval_boxed_fraction", "easyr1-geo", "eval", "0.5",
               (("assistant", "<think>Half.</think> \\boxed{\\frac{1}{2}}"),), None,
               total=1.0, accuracy=1.0, graders=("mathruler", "pylatexenc"),
               why="the preset's eval grades with MathRuler too"),
    GraderCase("deepeyes_judged_after_crop", "deepeyes", "rl", "red",
               (*CROP, ("assistant", "<think>It reads STOP on red.</think>\n<answer>The sign is red.</answer>")),
               "The sign is red.", num_tool_calls=1, judge_reply="Judgement: 1",
               total=2.0, accuracy=1.0, graders=("openai", "jinja2"),
               why="DeepEyes' compute_score: the judge (through the openai client, its prompt a Jinja template) "
                   "says 1: 0.8 x 1, format 0, and the 1.2 tool bonus for a right answer after a crop"),
    GraderCase("deepeyes_math_row_by_value", "deepeyes", "rl", "0.5",
               (("assistant", "<think>Half.</think> \\boxed{1/2}"),), None, data_source="thinklite_eureka",
               judge_reply="## Equivalence Judgement\nFALSE",
               total=1.2, accuracy=1.0, graders=("math-verify", "jinja2"),
               why="compute_score_math: math-verify finds 1/2 equal to 0.5 before the judge is asked (it would say "
                   "false); 1.2 x 1 + 0.4 x format 0"),
    GraderCase("deepeyes_geoguessr_row_judged", "deepeyes", "rl", "Paris, France",
               (*CROP, ("assistant", "<think>The tower is the Eiffel Tower.</think>\n<answer>Paris</answer>")),
               "Paris", data_source="geoguessr", num_tool_calls=1,
               judge_reply="## Equivalence Judgement\nTRUE",
               total=2.0, accuracy=1.0, graders=("openai", "jinja2"),
               why="compute_common_reasoning: the judge says equivalent: 0.8 x 1 + 0.2 x 0 + the 1.2 tool bonus"),
    GraderCase("mini_o3_judged", "mini-o3", "rl", "red",
               (("assistant", "<think>Crimson is red.</think>\n<answer>crimson</answer>"),), "crimson",
               judge_reply="Score: 1", total=1.0, accuracy=1.0, graders=("openai",),
               why="Mini-o3's reward is the judge's verdict on the first answer block"),
    GraderCase("mini_o3_eval_judged", "mini-o3", "eval", "red",
               (("assistant", "<think>Crimson is red.</think>\n<answer>crimson</answer>"),), "crimson",
               judge_reply="Score: 1", total=1.0, accuracy=1.0, graders=("openai",),
               why="eval's `judge`: exact match fails ('crimson' is not 'red'), the judge says 1"),
    GraderCase("pixel_reasoner_boxed_fraction", "pixel-reasoner", "rl", "0.5",
               (("assistant", "<think>Half.</think> The answer is \\boxed{\\frac{1}{2}}"),), None,
               total=1.0, accuracy=1.0, graders=("math-verify", "latex2sympy2-extended"),
               why="Pixel-Reasoner's rule_reward: the last \\boxed read by math-verify equals \\boxed{0.5}"),
    GraderCase("pixelis_partial_credit", "pixelis", "rl", "red square",
               (("assistant", "<think>A square, reddish.</think><answer>red squares</answer>"),), "red squares",
               total=0.5 * 20 / 21, accuracy=0.5 * 20 / 21, graders=(),
               why="Pixelis' task reward: half the difflib similarity (20/21) for an answer not written exactly as "
                   "the solution; no optional grader (the standard library's difflib)"),
    GraderCase("pixelis_ttrl_exact", "pixelis", "ttrl", "red",
               (("assistant", "<think>Red.</think><answer>Red.</answer>"),), "Red.",
               total=1.0, accuracy=1.0, graders=(),
               why="test-time RL's exact match, normalised (case, final period); no optional grader"),
)


def rules_of(reward: dict) -> set[str]:
    """Every `free_form_match` rule a reward section reaches: its own and each `by_data_source` entry's."""
    rules = {reward.get("free_form_match", "exact")}
    for entry in (reward.get("by_data_source") or {}).values():
        rules.add(entry.get("free_form_match", reward.get("free_form_match", "exact")))
    return rules


def scoring_sections(recipe: dict) -> dict[str, str]:
    """{params section: image} of every section whose reward a recipe's pipeline scores: synth (with a cold
    start), each RL-shaped section, eval."""
    from pipelines.params import PipelineParams

    pipeline = PipelineParams.model_validate(recipe.get("pipeline") or {})
    sections = {"synth": "synth"} if pipeline.sft else {}
    sections.update({name: "rl" for name in pipeline.rl_sections})
    sections["eval"] = "eval"
    return sections


def read_preset(preset: str) -> dict:
    """`params/<preset>.yaml` as `loupe run` reads it (merged over its base file), read once per process."""
    if preset not in _PRESETS:
        from pipelines.workspace import read_recipe

        _PRESETS[preset] = read_recipe(REPO, REPO / "params" / f"{preset}.yaml")
    return copy.deepcopy(_PRESETS[preset])


_PRESETS: dict[str, dict] = {}


def case_rule(case: GraderCase) -> str:
    """The `free_form_match` rule that scores `case` (its data source's, where its preset sets one)."""
    reward = reward_section(read_preset(case.preset), case.section)
    entry = (reward.get("by_data_source") or {}).get(case.data_source) or {}
    return entry.get("free_form_match", reward.get("free_form_match", "exact"))


def reward_section(recipe: dict, section: str) -> dict:
    return dict((recipe.get(section) or {}).get("reward") or {})


def payload(case: GraderCase, blocked: Iterable[str] = (), run_id: str | None = None) -> dict:
    """What the runner needs to score `case`: the preset's reward section as `loupe run` reads it (judges pointed
    at the runner's fake server, verdicts kept in memory), the trajectory, and the top-level modules whose import
    must fail (`blocked`: a package the image lacks)."""
    recipe = read_preset(case.preset)
    reward = reward_section(recipe, case.section)

    def local(judge: dict | None) -> dict | None:
        if judge is None:
            return None
        return {**judge, "base_url": "FAKE", **({"cache_dir": None} if "cache_dir" in judge else {})}

    reward["judge"] = local(reward.get("judge"))
    reward["by_data_source"] = {name: {**entry, **({"judge": local(entry["judge"])} if "judge" in entry else {})}
                                for name, entry in (reward.get("by_data_source") or {}).items()}
    task = {"doc_id": case.id, "images": ["scene.png"], "problem": "<image>\nWhat is the answer?",
            "solution": case.solution, "data_source": case.data_source}
    turns = [{"role": "user", "text": task["problem"], "images": [0]}]
    turns += [{"role": role, "text": text} for role, text in case.turns]
    trajectory = {"traj_id": f"{case.id}#0", "task": task, "protocol": recipe.get("protocol", {}).get("name", ""),
                  "system": "", "turns": turns, "images": ["scene.png"], "end_reason": case.end_reason,
                  "answer": case.answer, "num_tool_calls": case.num_tool_calls}
    return {"id": run_id or case.id, "reward": reward, "trajectory": trajectory, "judge_reply": case.judge_reply,
            "blocked": sorted(blocked)}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def modules_of(owners: dict[str, list[str]], keep: Callable[[str], bool]) -> set[str]:
    """The top-level import names (of `owners`, importlib.metadata's packages_distributions()) that only
    distributions `keep` refuses provide: what an environment without those distributions cannot import."""
    return {name for name, dists in owners.items() if not any(keep(canonical(d)) for d in dists)}


# --- the runner (standard library and loupe only) -------------------------------------------------------------

def _distributions(modules: set[str]) -> tuple[set[str], set[str]]:
    """The distributions owning `modules` (canonical names, `a|b` when several own a top-level name), and the
    third-party top-level names no distribution owns. The standard library and this repository's code
    (loupe, stages, the tests' helpers, installed as `loupe` in an image) are left out."""
    import sysconfig

    owners = _owners()
    stdlib = tuple(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib"))
    found, unowned = set(), set()
    for name in {m.split(".")[0] for m in modules}:
        if name in sys.stdlib_module_names or name in ("__main__", "loupe", "stages", "pipelines"):
            continue
        dists = sorted({canonical(d) for d in owners.get(name, [])})
        path = getattr(sys.modules.get(name), "__file__", None)
        if dists:
            found.add("|".join(dists))
        elif path and not path.startswith(stdlib) and Path(path).parent != Path(__file__).parent:
            unowned.add(name)  # (a module with no file is built in, a namespace, or Cython's shared runtime)
    return found, unowned


_OWNERS: dict[str, list[str]] = {}


def _owners() -> dict[str, list[str]]:
    """importlib.metadata's {top-level name: distributions}, read once (a second per read in a large venv) and
    inherited by every forked child."""
    if not _OWNERS:
        from importlib.metadata import packages_distributions

        _OWNERS.update(packages_distributions())
    return _OWNERS


def _score(case: dict) -> dict:
    from loupe.rewards import RewardConfig, build_judge, score_trajectory
    from loupe.trajectory import Trajectory

    for name in case["blocked"]:
        if name not in sys.modules:  # the baseline's own imports stay
            sys.modules[name] = None  # type: ignore[assignment]  # `import name` now raises ImportError
    server = None
    if case["judge_reply"] is not None:
        from fake_openai import FakeOpenAIServer

        reply = case["judge_reply"]
        server = FakeOpenAIServer(lambda request: reply, api_key="sk-grader-test").start()
        for judge in [case["reward"].get("judge")] + [e.get("judge") for e in case["reward"]["by_data_source"].values()]:
            if judge:
                judge["base_url"] = server.base_url
                os.environ[judge.get("api_key_env") or "OPENAI_API_KEY"] = "sk-grader-test"
    try:
        cfg = RewardConfig.model_validate(case["reward"])
        parts = score_trajectory(Trajectory.from_json(case["trajectory"]), cfg, build_judge(cfg))
        return {**parts.to_dict(), "judge_calls": server.count() if server else 0}
    finally:
        if server is not None:
            server.stop()


def _child(case: dict, baseline: set[str]) -> dict:
    try:
        result = {"id": case["id"], **_score(case)}
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which decides
        result = {"id": case["id"], "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    new = {name for name, module in sys.modules.items() if module is not None} - baseline
    result["distributions"], result["unowned"] = map(sorted, _distributions(new))
    return result


def _start(case: dict, baseline: set[str]) -> tuple[int, int]:
    """Fork a child scoring `case`; returns its pid and the read end of the pipe its result comes back on."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            data = json.dumps(_child(case, baseline)).encode()
            while data:
                data = data[os.write(write_end, data):]
        finally:
            os._exit(0)
    os.close(write_end)
    return pid, read_end


def run(cases: list[dict], workers: int = os.cpu_count() or 1) -> list[dict]:
    """Score each case in a child forked from this process (so each starts from the same imports), `workers`
    children at a time."""
    import loupe.rewards  # the baseline every reward path starts from
    import loupe.trajectory  # noqa: F401

    baseline = {name for name, module in sys.modules.items() if module is not None}
    base_found, base_unowned = _distributions(baseline)
    results, running, todo = [], [], list(cases)
    while todo or running:
        while todo and len(running) < workers:
            case = todo.pop(0)
            running.append((case, *_start(case, baseline)))
        case, pid, read_end = running.pop(0)
        with os.fdopen(read_end, "rb") as pipe:
            data = pipe.read()
        os.waitpid(pid, 0)
        result = json.loads(data) if data else {"id": case["id"], "error": "the child died without a result"}
        result["distributions"] = sorted(set(result.get("distributions", [])) | base_found)
        result["unowned"] = sorted(set(result.get("unowned", [])) | base_unowned)
        results.append(result)
    return results


if __name__ == "__main__":
    for line in run(json.loads(Path(sys.argv[1]).read_text())):
        print(json.dumps(line), flush=True)
