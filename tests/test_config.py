"""Config loading, overrides and validation: what a user sees when a recipe is right or wrong."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from conftest import ARITH, HPCRL, PYTHON, REPO, TINY_MODEL, run
from omegaconf import OmegaConf

from hpcrl.cli import main as cli_main
from hpcrl.config import ConfigError, load_config, role_layouts, rollout_layout
from hpcrl.trainer.preflight import preflight

TINY = str(REPO / "configs" / "grpo_tiny.yaml")


@pytest.fixture(autouse=True)
def _from_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # recipes name models/ and data/ relative to the repo root


def problems_of(*overrides: str, path: str = TINY, check_paths: bool = True) -> list[str]:
    with pytest.raises(ConfigError) as e:
        preflight(load_config(path, overrides), check_paths=check_paths)
    return e.value.problems


@pytest.mark.parametrize("recipe,check_paths", [
    ("grpo_tiny.yaml", True), ("grpo_smollm2.yaml", True), ("ppo_70b.yaml", False), ("grpo_tools_tiny.yaml", True),
    ("grpo_tools_smollm2.yaml", True), ("grpo_long_tiny.yaml", True), ("grpo_tiny_moe.yaml", True)])
def test_shipped_recipes_validate(recipe: str, check_paths: bool) -> None:
    preflight(load_config(REPO / "configs" / recipe), check_paths=check_paths)


def test_ppo_70b_layout_is_the_documented_one() -> None:
    cfg = load_config(REPO / "configs" / "ppo_70b.yaml")
    lay = role_layouts(cfg)
    assert (lay["actor"].tp, lay["actor"].pp, lay["actor"].dp) == (8, 8, 4)
    assert (lay["critic"].tp, lay["critic"].pp, lay["critic"].dp) == (8, 8, 4)
    assert "reference" in lay
    assert (rollout_layout(cfg).tp, rollout_layout(cfg).dp) == (8, 32)


def test_overrides_are_typed_and_interpolations_resolved() -> None:
    cfg = load_config(TINY, ["trainer.total_steps=3", 'rollout.stop=["####", "\\n\\n"]', "critic.enable=null",
                             "actor.optim.lr=2e-5", "trainer.experiment=my run",
                             "rollout.engine_kwargs.max_num_seqs=8"])
    assert cfg.trainer.total_steps == 3 and isinstance(cfg.trainer.total_steps, int)
    assert list(cfg.rollout.stop) == ["####", "\n\n"]
    assert cfg.critic.enable is None
    assert cfg.actor.optim.lr == pytest.approx(2e-5)
    assert cfg.trainer.run_dir == "runs/hpcrl/my run"  # ${trainer.experiment} resolved
    assert cfg.checkpoint.dir == "runs/hpcrl/my run/checkpoints"
    assert cfg.rollout.engine_kwargs.max_num_seqs == 8  # passed-through engine args accept new keys


def test_override_fills_a_null_section_from_its_dataclass() -> None:
    cfg = load_config(TINY, ["reference.enable=true", "reference.parallel.tensor_parallel=2"])
    assert cfg.reference.parallel.tensor_parallel == 2 and cfg.reference.parallel.pipeline_parallel == 1
    preflight(cfg)
    assert role_layouts(cfg)["reference"].dp == 2


def test_colocated_megatron_roles_share_one_layout() -> None:
    (msg,) = problems_of("algorithm.adv_estimator=gae", "critic.parallel.tensor_parallel=1")
    assert msg.startswith("critic.parallel: TP=1 PP=1 differs from actor.parallel (TP=2 PP=1)")
    (msg,) = problems_of("reference.enable=true", "reference.parallel.pipeline_parallel=2")
    assert msg.startswith("reference.parallel:")


def test_long_sequence_layouts_and_what_they_allow() -> None:
    """The world is TP x PP x CP x DP (DP what the others leave); a layout prints CP and SP only when
    they are used; the padded baseline with CP, a critic whose SP differs from the actor's, and each
    recompute mode validate."""
    from hpcrl.config import Layout

    cfg = load_config(REPO / "configs" / "grpo_long_tiny.yaml")
    lay = role_layouts(cfg)
    assert lay["actor"] == Layout(2, 1, 1, 2, True) and str(lay["actor"]) == "TP=2 PP=1 CP=2 DP=1 SP"
    assert lay["reference"] == lay["actor"]  # colocated: the actor's layout
    assert lay["actor"].token_multiple == 8  # 2 x CP chunks, each rank's part cut over TP
    assert Layout(2, 1, 2) == Layout(2, 1, 2, cp=1, sp=False) and str(Layout(2, 1, 2)) == "TP=2 PP=1 DP=2"
    cp_only = load_config(TINY, ["actor.parallel.tensor_parallel=1", "actor.parallel.context_parallel=2"])
    assert role_layouts(cp_only)["actor"] == Layout(1, 1, 2, 2) and str(Layout(1, 1, 2, 2)) == "TP=1 PP=1 CP=2 DP=2"
    for overrides in (
            # the padded baseline packs nothing: its token budget is not used
            ["actor.parallel.context_parallel=2", "actor.packing=false", "actor.micro_batch_tokens=2047"],
            # sequence parallel changes a role's own communication, not the process groups
            ["algorithm.adv_estimator=gae", "critic.parallel.tensor_parallel=2",
             "actor.parallel.sequence_parallel=true"],
            ["actor.recompute=selective"],
            ["algorithm.adv_estimator=gae", "actor.recompute=full", "critic.recompute=selective"]):
        preflight(load_config(TINY, overrides))


def test_unknown_key_named_in_yaml_and_override(tmp_path) -> None:
    assert any(p.startswith("no_such.key: unknown key") for p in problems_of("no_such.key=1"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  paralel:\n    tensor_parallel: 2\n")
    msg = problems_of(path=str(bad))[0]
    assert "actor.paralel" in msg and "unknown key" in msg and "Did you mean: actor.parallel" in msg


def test_wrong_type_names_key_and_type() -> None:
    (msg,) = problems_of("actor.parallel.tensor_parallel=two")
    assert msg.startswith("actor.parallel.tensor_parallel:") and "int" in msg


def test_not_an_override_is_refused() -> None:
    with pytest.raises(ConfigError, match="not an override"):
        load_config(TINY, ["trainer.total_steps"])


@pytest.mark.parametrize("override,key,expect", [
    ("actor.parallel.tensor_parallel=3", "actor.parallel.tensor_parallel=3", "world size 4"),
    ("trainer.workers_per_node=3", "actor.parallel.tensor_parallel=2", "world size 3"),
    ("actor.parallel.data_parallel=4", "actor.parallel.data_parallel=4", "world size is 4"),
    ("rollout.tensor_parallel=3", "rollout.tensor_parallel=3", "world size 4"),
])
def test_layout_arithmetic_names_key_and_world_size(override: str, key: str, expect: str) -> None:
    problems = problems_of(override)
    assert any(p.startswith(key) and expect in p for p in problems), problems


def test_model_shape_against_layout() -> None:
    # the tiny model has 4 heads / 2 KV heads and 2 layers
    (msg,) = problems_of("actor.parallel.tensor_parallel=4")
    assert msg.startswith("actor.parallel.tensor_parallel=4") and "2 KV heads" in msg
    (msg,) = problems_of("actor.parallel.tensor_parallel=1", "actor.parallel.pipeline_parallel=4",
                         "actor.ppo_mini_batch_size=8")
    assert msg.startswith("actor.parallel.pipeline_parallel=4") and "2 layers" in msg
    # vLLM replicates KV heads, so rollout TP=4 over 2 KV heads is fine
    preflight(load_config(TINY, ["rollout.tensor_parallel=4"]))


def test_batch_arithmetic() -> None:
    (msg,) = problems_of("actor.ppo_mini_batch_size=12")
    assert msg.startswith("actor.ppo_mini_batch_size=12") and "32 samples" in msg
    (msg,) = problems_of("actor.parallel.tensor_parallel=1", "actor.ppo_mini_batch_size=2")
    assert msg.startswith("actor.ppo_mini_batch_size=2") and "data-parallel size 4" in msg
    (msg,) = problems_of("rollout.n=1", "actor.ppo_mini_batch_size=8")
    assert msg.startswith("rollout.n=1") and "grpo" in msg


def test_choices_ranges_and_all_problems_reported_together() -> None:
    problems = problems_of("algorithm.adv_estimator=ppo", "rollout.top_p=0", "slurm.time=2h",
                           "reward.function=not a function", "actor.minibatch_by=group")
    keys = [p.split("=")[0] for p in problems]
    assert keys == ["actor.minibatch_by", "algorithm.adv_estimator", "rollout.top_p", "slurm.time",
                    "reward.function"], problems
    assert "prompt, sample" in problems[0] and "gae, grpo, rloo" in problems[1]


def test_gae_without_critic_is_refused() -> None:
    (msg,) = problems_of("algorithm.adv_estimator=gae", "critic.enable=false")
    assert msg.startswith("critic.enable=false") and "gae" in msg


def test_paths_must_exist(tmp_path) -> None:
    problems = problems_of(f"model.path={tmp_path}/nope", f"data.train_files=[{tmp_path}/x.parquet]",
                           f"checkpoint.resume={tmp_path}/ckpt", "reward.function=no_such_module_xyz:score")
    assert [p.split("=")[0] for p in problems] == [
        "model.path", "data.train_files[0]", "checkpoint.resume", "reward.function"], problems
    assert "does not exist" in problems[0]
    # with path checks off, the same config passes (preparing a cluster recipe elsewhere)
    preflight(load_config(TINY, [f"model.path={tmp_path}/nope"]), check_paths=False)


def test_missing_mandatory_model_path(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"train_files": [str(ARITH / "train.parquet")]}}))
    with pytest.raises(ConfigError, match=r"model\.path: required but not set"):
        load_config(cfg)


def test_cli_config_exit_codes_and_messages() -> None:
    r = run([HPCRL, "config", TINY, "no_such.key=1"])
    assert r.returncode == 2 and "no_such.key" in r.stderr and r.stdout == ""
    r = run([HPCRL, "config", TINY, "actor.parallel.tensor_parallel=3"])
    assert r.returncode == 2
    assert "actor.parallel.tensor_parallel=3" in r.stderr and "world size 4" in r.stderr
    r = run([HPCRL, "config", "configs/does_not_exist.yaml"])
    assert r.returncode == 2 and "does_not_exist.yaml" in r.stderr


def test_cli_checks_a_config_without_importing_torch() -> None:
    """`hpcrl run`, `hpcrl config` and `hpcrl submit` check the config (the preflight, the model's architecture
    included) and build the launch command in a process that imports no torch (~2.3 s of CPU each time): the
    launch command of `run`, `config`'s output, `submit --dry-run`'s whole batch script. The control: the
    Megatron model module does import it."""
    probe = """
import contextlib, io, sys
from hpcrl.cli import build_parser, load_validated
from hpcrl.config.derived import world_size
from hpcrl.launch import entry_argv, mpiexec_command
cfg = load_validated(build_parser().parse_args(["run", sys.argv[1]]))
mpiexec_command(world_size(cfg), entry_argv("hpcrl.trainer.main:main", []))
print("torch" in sys.modules, file=sys.stderr)
for argv in (["config", "configs/grpo_tiny_moe.yaml"], ["submit", "--dry-run", sys.argv[1]]):
    args = build_parser().parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        assert args.func(args) == 0
    print("torch" in sys.modules, file=sys.stderr)
import hpcrl.engines.megatron.model
print("torch" in sys.modules, file=sys.stderr)
"""
    r = run([PYTHON, "-c", probe, TINY])
    said = [line for line in r.stderr.splitlines() if line in ("True", "False")]
    assert r.returncode == 0 and said == ["False", "False", "False", "True"], r.stderr[-3000:]


def test_cli_config_prints_a_config_that_reloads_identically(tmp_path) -> None:
    r = run([HPCRL, "config", TINY, "trainer.total_steps=7"])
    assert r.returncode == 0, r.stderr
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(r.stdout)
    again = load_config(dumped)
    assert OmegaConf.to_container(again) == OmegaConf.to_container(load_config(TINY, ["trainer.total_steps=7"]))
    r = run([HPCRL, "config", TINY, "--format", "json"])
    assert json.loads(r.stdout)["model"]["path"] == str(TINY_MODEL.relative_to(REPO))


def test_cli_plan() -> None:
    r = run([HPCRL, "plan", TINY])
    assert r.returncode == 0, r.stderr
    assert "actor       TP=2 PP=1 DP=2" in r.stdout and "rollout     TP=1 DP=4" in r.stdout
    assert "MPI world of 5" in r.stdout and "Qwen2ForCausalLM: 2 layers" in r.stdout
    r = run([HPCRL, "plan", "configs/ppo_70b.yaml", "--skip-path-checks"])
    assert r.returncode == 0 and "MPI world of 257" in r.stdout and "critic      TP=8 PP=8 DP=4" in r.stdout
    r = run([HPCRL, "plan", "configs/ppo_70b.yaml"])  # the 70B model is not on this machine
    assert r.returncode == 2 and "model.path=" in r.stderr


@pytest.mark.parametrize("key", ["trainer.workers_per_node", "trainer.nnodes"])
def test_zero_workers_exits_2_naming_the_key(key: str) -> None:
    r = run([HPCRL, "config", TINY, f"{key}=0"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{key}=0: must be >= 1" in r.stderr and "Traceback" not in r.stderr


def test_kl_loss_with_zero_coefficient_builds_no_reference() -> None:
    from hpcrl.config import reference_enabled

    assert reference_enabled(load_config(TINY, ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.01"]))
    assert not reference_enabled(load_config(TINY, ["actor.use_kl_loss=true", "actor.kl_loss_coef=0"]))
    assert "reference" not in role_layouts(load_config(TINY, ["actor.use_kl_loss=true", "actor.kl_loss_coef=0"]))


def test_training_temperature_must_be_positive() -> None:
    assert any(p.startswith("rollout.temperature=0") and "> 0" in p for p in problems_of("rollout.temperature=0"))


CATALOGUE = yaml.safe_load((REPO / "tests" / "data" / "malformed_configs.yaml").read_text())
# context parallel, sequence parallel and recompute (issue 38), as the catalogue's entries: overrides of
# grpo_tiny.yaml (TP=2 on 4 workers, micro_batch_tokens 2048, 4096 positions), the key, words it says
LONG_SEQUENCE_CASES = [
    {"overrides": ["actor.parallel.context_parallel=4"], "key": "actor.parallel.context_parallel=4",
     "says": "TP x PP x CP = 8 does not divide the 4 workers"},
    {"overrides": ["actor.parallel.context_parallel=3"], "key": "actor.parallel.context_parallel=3",
     "says": "context_parallel in {1, 2}"},
    {"overrides": ["actor.parallel.context_parallel=0"], "key": "actor.parallel.context_parallel", "says": ">= 1"},
    {"overrides": ["actor.parallel.tensor_parallel=1", "actor.parallel.sequence_parallel=true"],
     "key": "actor.parallel.sequence_parallel=true", "says": "needs actor.parallel.tensor_parallel > 1"},
    {"overrides": ["reference.enable=true", "reference.parallel.tensor_parallel=1",
                   "reference.parallel.sequence_parallel=true"],
     "key": "reference.parallel.sequence_parallel=true", "says": "needs reference.parallel.tensor_parallel > 1"},
    # 2 x CP = 4 places per chunk set: 2050 is not a multiple of 4
    {"overrides": ["actor.parallel.context_parallel=2", "actor.micro_batch_tokens=2050"],
     "key": "actor.micro_batch_tokens=2050",
     "says": "multiple of 4 (actor.parallel.context_parallel=2: 2 x CP chunks a sequence), the length every packed "
             "row is padded to a multiple of. Use 2048 or 2052."},
    # with sequence parallel x TP=2: a multiple of 8
    {"overrides": ["actor.parallel.context_parallel=2", "actor.parallel.sequence_parallel=true",
                   "actor.micro_batch_tokens=2052"],
     "key": "actor.micro_batch_tokens=2052", "says": "must be a multiple of 8"},
    {"overrides": ["actor.parallel.sequence_parallel=true", "actor.micro_batch_tokens=2047"],
     "key": "actor.micro_batch_tokens=2047", "says": "Use 2046 or 2048"},
    {"overrides": ["algorithm.adv_estimator=gae", "actor.parallel.context_parallel=2",
                   "critic.micro_batch_tokens=4094"], "key": "critic.micro_batch_tokens=4094",
     "says": "actor.parallel.context_parallel=2"},
    {"overrides": ["actor.parallel.context_parallel=2", "model.local_attention=dense"],
     "key": "model.local_attention=dense", "says": "actor.parallel.context_parallel=2"},
    {"overrides": ["actor.recompute=partial"], "key": "actor.recompute", "says": "none, selective, full"},
    # grpo_tiny's responses are at most 16 tokens
    {"overrides": ["rollout.min_new_tokens=17"], "key": "rollout.min_new_tokens=17",
     "says": "must be <= rollout.max_new_tokens=16"},
    {"overrides": ["rollout.min_new_tokens=-1"], "key": "rollout.min_new_tokens", "says": ">= 0"},
    {"overrides": ["algorithm.adv_estimator=gae", "critic.recompute=all"], "key": "critic.recompute",
     "says": "none, selective, full"},
    {"overrides": ["algorithm.adv_estimator=gae", "actor.parallel.context_parallel=2",
                   "critic.parallel.tensor_parallel=2"], "key": "critic.parallel",
     "says": "TP=2 PP=1 CP=1 differs from actor.parallel (TP=2 PP=1 CP=2)"},
    {"overrides": ["reference.enable=true", "reference.parallel.tensor_parallel=2",
                   "reference.parallel.context_parallel=2"], "key": "reference.parallel",
     "says": "differs from actor.parallel"},
    {"overrides": ["actor.parallel.context_parallel=2", "actor.parallel.data_parallel=2"],
     "key": "actor.parallel.data_parallel=2", "says": "TP x PP x CP x DP = 2x1x2x2 = 8, but world size is 4"},
    # DP = 4 / (TP 1 x CP 2) = 2: one sample per mini-batch cannot be split over it
    {"overrides": ["actor.parallel.tensor_parallel=1", "actor.parallel.context_parallel=2",
                   "actor.ppo_mini_batch_size=1"],
     "key": "actor.ppo_mini_batch_size=1", "says": "data-parallel size 2"},
    {"overrides": ["actor.parallel.sequence_parallel=true", "actor.lora.rank=8"],
     "key": "actor.parallel.sequence_parallel=true", "says": "not with LoRA"},
    # CP=3 on 3 workers: a 4096-token sample padded to a multiple of 6 needs 4098 of the 4096 positions
    {"overrides": ["trainer.workers_per_node=3", "actor.parallel.tensor_parallel=1",
                   "actor.parallel.context_parallel=3", "rollout.max_new_tokens=3968", "data.train_batch_size=6",
                   "actor.ppo_mini_batch_size=6", "actor.micro_batch_tokens=4098"],
     "key": "actor.parallel.context_parallel=3", "says": "takes 4098 positions, past the model's 4096"},
    {"overrides": ["algorithm.name=dpo", "actor.parallel.context_parallel=2"],
     "key": "actor.parallel.context_parallel=2", "says": "not with algorithm.name=dpo"},
]

# Mixture of experts: expert parallel, the routers' losses, routing replay. grpo_tiny's model is dense
# (no num_experts), its layout TP=2 on 4 workers: DP x CP = 2.
MOE_CASES = [
    {"overrides": ["actor.parallel.expert_parallel=4"], "key": "actor.parallel.expert_parallel=4",
     "says": "does not divide the actor's DP x CP = 2 (the 4 trainer workers / TP=2 x PP=1)"},
    {"overrides": ["actor.parallel.tensor_parallel=1", "actor.parallel.context_parallel=2",
                   "actor.parallel.expert_parallel=3"], "key": "actor.parallel.expert_parallel=3",
     "says": "Use expert_parallel in {1, 2, 4}"},
    {"overrides": ["actor.parallel.expert_parallel=0"], "key": "actor.parallel.expert_parallel", "says": ">= 1"},
    {"overrides": ["actor.moe.aux_loss_coeff=-0.01"], "key": "actor.moe.aux_loss_coeff", "says": ">= 0"},
    {"overrides": ["algorithm.adv_estimator=gae", "critic.moe.z_loss_coeff=-1e-3"], "key": "critic.moe.z_loss_coeff",
     "says": ">= 0"},
    # the colocated roles share megatron's process groups, the expert-parallel ones too
    {"overrides": ["reference.enable=true", "reference.parallel.tensor_parallel=2",
                   "reference.parallel.expert_parallel=2"], "key": "reference.parallel",
     "says": "TP=2 PP=1 EP=2 differs from actor.parallel (TP=2 PP=1 EP=1)"},
    # the MoE keys with a dense model
    {"overrides": ["actor.parallel.expert_parallel=2"], "key": "actor.parallel.expert_parallel=2",
     "says": "is dense (no num_experts in its config.json)"},
    {"overrides": ["actor.moe.aux_loss_coeff=0.01"], "key": "actor.moe.aux_loss_coeff=0.01", "says": "is dense"},
    {"overrides": ["actor.moe.z_loss_coeff=0.001"], "key": "actor.moe.z_loss_coeff=0.001", "says": "is dense"},
    {"overrides": ["algorithm.adv_estimator=gae", "critic.moe.aux_loss_coeff=0.01"],
     "key": "critic.moe.aux_loss_coeff=0.01", "says": "is dense"},
]
ALL_CASES = CATALOGUE + LONG_SEQUENCE_CASES + MOE_CASES


@pytest.mark.parametrize("case", ALL_CASES, ids=[" ".join(c["overrides"]) for c in ALL_CASES])
def test_malformed_config_is_refused_naming_the_key(case: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command's entry point (`hpcrl config`, in this process): exit status 2, nothing on
    stdout, and a problem line on stderr that starts with the key and says what is wrong."""
    status = cli_main(["config", TINY, *case["overrides"]])
    out, err = capsys.readouterr()
    assert status == 2 and out == "", (status, out[-500:], err)
    assert "Traceback" not in err
    named = [line for line in err.splitlines() if line.startswith(f"  - {case['key']}")]
    assert named, err
    assert case.get("says", "") in named[0], named


def test_data_with_too_many_unusable_rows_is_refused_before_launch(tmp_path) -> None:
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "data_source": "hpcrl/arith",
                        "reward_model": {"ground_truth": str(i + 1)}}) for i in range(9)]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join([*rows, '{"prompt": 3}']) + "\n")  # 1 of 10 rows unusable
    (msg,) = problems_of(f"data.train_files=[{f}]")
    assert msg.startswith("data.train_files[0]=") and "1 of 10 rows unusable" in msg and "row 9" in msg, msg
    preflight(load_config(TINY, [f"data.train_files=[{f}]", "data.max_skipped_row_share=0.1"]))


def test_catalogue_is_large_and_run_refuses_before_launch(tmp_path) -> None:
    assert len(CATALOGUE) >= 30
    # `hpcrl run` exits 2 before starting any process, and writes nothing: not even the run folder
    run_dir = tmp_path / "run"
    for case in (CATALOGUE[0], CATALOGUE[-1]):
        r = run([HPCRL, "run", TINY, f"trainer.run_dir={run_dir}", *case["overrides"]], timeout=60)
        assert r.returncode == 2 and case["key"] in r.stderr, r.stderr
        assert not run_dir.exists()


def test_multi_turn_problems_name_the_key() -> None:
    tools = str(REPO / "configs" / "grpo_tools_tiny.yaml")
    assert problems_of("rollout.multi_turn.tools=[]", path=tools) == [
        "rollout.multi_turn.tools: empty; rollout.multi_turn.enable=true needs at least one tool (built-in: "
        "calculator, python, or {class: 'package.module:Class'})."]
    (msg,) = problems_of('rollout.multi_turn.tools=["calculator", "nope"]', path=tools)
    assert msg.startswith('rollout.multi_turn.tools[1]="nope": use a built-in name (calculator, python)'), msg
    (msg,) = problems_of('rollout.multi_turn.tools=[{class: "no_such_pkg.mod:Tool"}]', path=tools)
    assert msg.startswith("rollout.multi_turn.tools[0]=") and "'no_such_pkg.mod' is not importable" in msg, msg
    (msg,) = problems_of('rollout.multi_turn.tools=[{klass: calculator}]', path=tools)
    assert "unknown keys ['klass']" in msg, msg
    (msg,) = problems_of("rollout.multi_turn.format=xml", path=tools)
    assert msg.startswith('rollout.multi_turn.format="xml": use a built-in name (hermes)'), msg
    (msg,) = problems_of("rollout.multi_turn.max_turns=0", path=tools)
    assert msg == "rollout.multi_turn.max_turns=0: must be >= 1.", msg
    (msg,) = problems_of("algorithm.overlong_buffer=4", path=tools)
    assert msg.startswith("algorithm.overlong_buffer=4: DAPO's overlong penalty"), msg
    # the tiny model has 4096 positions; 128 prompt tokens + 4000 would not fit
    (msg,) = problems_of("rollout.multi_turn.max_total_tokens=4000", path=tools)
    assert msg.startswith("rollout.multi_turn.max_total_tokens=4000: with data.max_prompt_length=128"), msg
    # off (the default): nothing is checked
    preflight(load_config(TINY, ["rollout.multi_turn.format=xml"]))


def test_the_switches_of_a_malformed_catalogue_entry_are_each_fine_alone() -> None:
    """The controls of the RL-loop entries at the end of the catalogue: each key alone validates, so
    the refusal is about the combination."""
    for overrides in (["reference.enable=false"], ["algorithm.use_kl_in_reward=true"],
                      ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.01"],
                      ["reference.enable=false", "actor.use_kl_loss=true", "actor.kl_loss_coef=0"],
                      ["algorithm.policy_loss=clip_higher", "actor.clip_ratio_high=0.28"],
                      ["actor.lora.rank=8"]):
        preflight(load_config(TINY, overrides))
    # DPO has no ratio: LoRA dropout is allowed there
    preflight(load_config(REPO / "configs" / "dpo_tiny.yaml", ["actor.lora.rank=8", "actor.lora.dropout=0.1"]))


def test_top_p_or_top_k_with_rollout_log_probs_warns(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's log-probs under top-p / top-k are renormalised over the kept tokens: with the rollout's
    log-probs as old log-probs, or TIS, the ratio is biased. A warning (the config still runs), naming
    the keys, from the config check and on stderr of the commands."""
    from hpcrl.config.validate import config_warnings

    def warned(*overrides: str) -> list[str]:
        return config_warnings(load_config(TINY, list(overrides)))

    (w,) = warned("rollout.top_p=0.9", "actor.old_logprob=rollout")
    assert w.startswith("rollout.top_p=0.9 with actor.old_logprob=rollout: vLLM's log-probs are renormalised"), w
    (w,) = warned("rollout.top_k=20", "rollout.top_p=0.95", "algorithm.rollout_correction=tis")
    assert w.startswith("rollout.top_p=0.95 and rollout.top_k=20 with algorithm.rollout_correction=tis"), w
    # the controls: the cut alone, or the rollout's log-probs without a cut, warn of nothing
    assert warned("rollout.top_p=0.9") == warned("rollout.top_k=20", "actor.old_logprob=recompute") == []
    assert warned("actor.old_logprob=rollout") == warned("algorithm.rollout_correction=tis") == []
    # vLLM's min_tokens masks the end of sequence until then: the same renormalisation
    (w,) = warned("rollout.min_new_tokens=8", "actor.old_logprob=rollout")
    assert w.startswith("rollout.min_new_tokens=8 with actor.old_logprob=rollout: vLLM's log-probs"), w
    assert warned("rollout.min_new_tokens=8") == []
    assert cli_main(["config", TINY, "rollout.top_k=20", "actor.old_logprob=rollout"]) == 0
    err = capsys.readouterr().err
    assert "hpcrl config: warning: rollout.top_k=20 with actor.old_logprob=rollout" in err, err


def test_options_go_before_or_after_the_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's intermixed parsing on every sub-command: options after KEY=VALUE overrides are
    taken (before: "unrecognized arguments"), and `hpcrl plan --nodes/--gpus-per-node` apply before
    the config is validated (before: a layout that needs the larger cluster was refused for the
    recipe's own worker count)."""
    assert cli_main(["config", TINY, "--format", "json", "trainer.total_steps=3"]) == 0
    assert json.loads(capsys.readouterr().out)["trainer"]["total_steps"] == 3
    assert cli_main(["config", TINY, "trainer.total_steps=4", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainer"]["total_steps"] == 4
    # TP x PP = 4 does not divide the recipe's 2 workers, but does the 4 of --nodes 2
    layout = ["trainer.workers_per_node=2", "actor.parallel.pipeline_parallel=2"]
    for argv in (["plan", "--nodes", "2", TINY, *layout], ["plan", TINY, *layout, "--nodes", "2"],
                 ["plan", TINY, layout[0], "--nodes", "2", layout[1]]):
        assert cli_main(argv) == 0, argv
        out = capsys.readouterr().out
        assert "workers     4 = trainer.nnodes 2 x trainer.workers_per_node 2" in out, out
        assert "actor       TP=2 PP=2 DP=1" in out, out
    # the control: without --nodes the recipe's 2 workers cannot take the layout (exit 2, the key)
    assert cli_main(["plan", TINY, *layout]) == 2
    assert "  - actor.parallel.tensor_parallel=2, actor.parallel.pipeline_parallel=2: TP x PP = 4 does not divide" \
        in capsys.readouterr().err
    # a config that is wrong whatever the node count is refused naming the key (not "does not fit"), at once:
    # the search for the fewest nodes that place a layout validated the whole config at each of 1024 counts
    # (9.5 CPU-s, measured alone)
    cpu = time.process_time()
    assert cli_main(["plan", TINY, "rollout.n=0", "--nodes", "2"]) == 2
    assert time.process_time() - cpu < 2.0
    assert "  - rollout.n=0: must be >= 1" in capsys.readouterr().err
    # the other sub-commands that take overrides parse the same way
    from hpcrl.cli import build_parser

    parser = build_parser()
    for argv in (["run", TINY, "trainer.total_steps=2", "--verbose", "--skip-path-checks"],
                 ["submit", TINY, "trainer.total_steps=2", "--nodes", "2", "--dry-run", "--time", "30"]):
        args = parser.parse_args(argv)
        assert args.config == TINY and args.overrides == ["trainer.total_steps=2"], args
        assert (args.verbose and args.skip_path_checks) if argv[0] == "run" else (args.nodes, args.time) == (2, "30")
    # sub-commands of sub-commands still parse (argparse cannot intermix those: plain parsing)
    args = parser.parse_args(["ckpt", "verify", "runs/x", "--step", "3"])
    assert (args.ckpt_command, args.run_dir, args.step) == ("verify", "runs/x", 3)


# A Qwen3-MoE-like config.json (tiny: 2 layers, 4 heads / 2 KV heads, 8 experts of 64, top 2): the
# preflight reads only config.json, so a folder holding it is a model folder to `hpcrl config`.
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
             "intermediate_size": 512, "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
             "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2, "max_position_embeddings": 4096,
             "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True}
QWEN3 = {k: v for k, v in QWEN3_MOE.items() if k not in ("moe_intermediate_size", "num_experts", "num_experts_per_tok",
                                                          "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
QWEN3.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")


def hf_folder(tmp_path, name: str, hf: dict, **changes) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**hf, **changes}))
    return str(folder)


def test_moe_layouts_print_ep_only_when_used(tmp_path) -> None:
    from hpcrl.config import Layout

    assert str(Layout(2, 1, 2, ep=2)) == "TP=2 PP=1 EP=2 DP=2"
    assert str(Layout(1, 1, 2, 2, True, 4)) == "TP=1 PP=1 CP=2 EP=4 DP=2 SP"
    assert Layout(2, 1, 2) == Layout(2, 1, 2, ep=1) and str(Layout(2, 1, 2, ep=1)) == "TP=2 PP=1 DP=2"
    moe = hf_folder(tmp_path, "moe", QWEN3_MOE)
    lay = role_layouts(load_config(TINY, [f"model.path={moe}", "actor.parallel.expert_parallel=2",
                                          "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01"]))
    assert lay["actor"] == Layout(2, 1, 2, ep=2) and lay["reference"] == lay["actor"]  # colocated: the actor's
    assert role_layouts(load_config(TINY))["actor"].ep == 1


def test_moe_model_with_the_moe_keys_validates(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """An MoE model takes the routers' losses in every trained role, TP with sequence parallel, and
    TP=1, expert parallel dividing the experts and DP; a dense Qwen3 takes the defaults. (Context
    parallel on an MoE model is refused until a check runs it: tests/data/malformed_configs.yaml.)"""
    moe = hf_folder(tmp_path, "moe", QWEN3_MOE)
    for overrides in (
            ["actor.parallel.sequence_parallel=true", "actor.moe.aux_loss_coeff=0.001",
             "actor.moe.z_loss_coeff=0.001"],
            ["actor.parallel.tensor_parallel=1", "actor.ppo_mini_batch_size=8"],
            ["actor.parallel.tensor_parallel=1", "actor.parallel.expert_parallel=4"],
            ["actor.parallel.sequence_parallel=true", "actor.parallel.expert_parallel=2"],
            ["algorithm.adv_estimator=gae", "actor.parallel.sequence_parallel=true",
             "critic.parallel.tensor_parallel=2", "critic.parallel.sequence_parallel=true",
             "critic.moe.aux_loss_coeff=0.01"]):
        preflight(load_config(TINY, [f"model.path={moe}", *overrides]))
    preflight(load_config(TINY, [f"model.path={hf_folder(tmp_path, 'dense', QWEN3)}"]))
    assert cli_main(["plan", TINY, f"model.path={moe}", "actor.parallel.sequence_parallel=true"]) == 0
    assert "actor       TP=2 PP=1 DP=2 SP" in capsys.readouterr().out


# (folder's config.json, overrides, the key the problem starts with, words it says)
MOE_MODEL_CASES = [
    ({"architectures": ["GemmaForCausalLM"]}, [], "model.path=",
     "architecture 'GemmaForCausalLM' (config.json's architectures) is not one hpcrl converts: LlamaForCausalLM, "),
    # DP x CP = 4 with TP=1: EP=4 divides it, not the 6 experts
    ({"num_experts": 6}, ["actor.parallel.tensor_parallel=1", "actor.parallel.expert_parallel=4"],
     "actor.parallel.expert_parallel=4", "the model has 6 experts per MoE layer (num_experts); EP must divide them, "
     "and the actor's DP x CP = 4. Use expert_parallel in {1, 2}."),
    ({"num_experts": 6}, ["reference.enable=true", "reference.parallel.tensor_parallel=1",
                          "reference.parallel.expert_parallel=4", "actor.parallel.tensor_parallel=1",
                          "actor.parallel.expert_parallel=4"], "reference.parallel.expert_parallel=4", "6 experts"),
    ({"mlp_only_layers": [0]}, [], "model.path=", "MoE on some layers only (mlp_only_layers=[0]"),
    ({"decoder_sparse_step": 2}, [], "model.path=", "hpcrl supports MoE models whose every layer is MoE"),
    ({"shared_expert_intermediate_size": 256}, [], "model.path=",
     "shared experts (shared_expert_intermediate_size=256) are not supported yet"),
    # megatron's MoE layer trains at TP > 1 with sequence parallel only
    ({}, [], "actor.parallel.sequence_parallel=false", "trains at tensor parallel 2 with sequence parallel only"),
]


@pytest.mark.parametrize("changes,overrides,key,says", MOE_MODEL_CASES,
                         ids=[" ".join([json.dumps(c[0]), *c[1]]) for c in MOE_MODEL_CASES])
def test_moe_model_problems_name_the_key(tmp_path, capsys: pytest.CaptureFixture[str], changes: dict,
                                         overrides: list[str], key: str, says: str) -> None:
    """The MoE model's shape against the keys, through `hpcrl config`: exit 2, the key, what to do."""
    moe = hf_folder(tmp_path, "model", QWEN3_MOE, **changes)
    status = cli_main(["config", TINY, f"model.path={moe}", *overrides])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "Traceback" not in err, (status, out[-500:], err)
    named = [line for line in err.splitlines() if line.startswith(f"  - {key}")]
    assert named and says in named[0], err
    if key == "model.path=":
        assert f"model.path={moe!r}" in named[0], named


def test_dense_qwen3_refuses_each_moe_key(tmp_path) -> None:
    dense = hf_folder(tmp_path, "dense", QWEN3)
    problems = problems_of(f"model.path={dense}", "actor.parallel.expert_parallel=2", "actor.moe.aux_loss_coeff=0.01")
    assert [p.split("=")[0] for p in problems] == ["actor.parallel.expert_parallel", "actor.moe.aux_loss_coeff"], \
        problems
    assert all(f"the model (model.path={dense!r}) is dense" in p for p in problems), problems


# actor.engine=fsdp (hpcrl.engines.fsdp): what it does not do, and its options with the Megatron engine,
# refused naming the key (hpcrl config exits 2 on these before anything starts)
FSDP = ["actor.engine=fsdp", "actor.parallel.tensor_parallel=1"]


@pytest.mark.parametrize("overrides,key,words", [
    (["actor.engine=fsdp"], "actor.parallel.tensor_parallel=2", "shards over data parallel only"),
    ([*FSDP, "actor.parallel.pipeline_parallel=2"], "actor.parallel.pipeline_parallel=2", "data parallel only"),
    ([*FSDP, "critic.enable=true", "critic.parallel.tensor_parallel=2"], "critic.parallel.tensor_parallel=2",
     "the FSDP engine (critic)"),
    ([*FSDP, "actor.recompute=selective"], "actor.recompute=selective", "whole layers (full) or nothing"),
    (["actor.fsdp.cpu_offload=true"], "actor.fsdp.cpu_offload=True", "no role runs on it"),
    (["actor.fsdp.accumulate_unsharded=true"], "actor.fsdp.accumulate_unsharded=True", "no role runs on it"),
    (["actor.engine=fsdpp"], "actor.engine='fsdpp'", "not one of megatron, fsdp"),
    (["actor.fsdp.attn_implementation=eager"], "actor.fsdp.attn_implementation=eager", "no role runs on it"),
    ([*FSDP, "actor.fsdp.attn_implementation=sdpaa"], "actor.fsdp.attn_implementation=sdpaa",
     "not an attention implementation of transformers"),
    ([*FSDP, "trainer.device=cpu", "actor.fsdp.attn_implementation=flash_attention_2"],
     "actor.fsdp.attn_implementation=flash_attention_2", "needs a CUDA device"),
])
def test_fsdp_engine_options_refused_by_key(overrides: list[str], key: str, words: str) -> None:
    problems = problems_of(*overrides)
    assert any(p.startswith(key) and words in p for p in problems), problems


def test_fsdp_engine_names_the_attention_it_cannot_load(tmp_path) -> None:
    """What the config checks cannot judge (a package the implementation needs, a model without it) the
    engine refuses naming actor.fsdp.attn_implementation; a folder transformers cannot build names
    model.path; a valid choice loads."""
    from hpcrl.engines.fsdp.engine import _load_hf

    tiny = str(REPO / "models" / "tiny-qwen2")
    with pytest.raises(ValueError, match=r"^actor.fsdp.attn_implementation=flash_attention_2: transformers "
                                         r"cannot load .*Set it to null"):
        _load_hf(tiny, "flash_attention_2", cuda=False)  # no flash_attn package here
    with pytest.raises(ValueError, match=r"^model.path=.*: transformers cannot build it as a causal LM"):
        _load_hf(str(tmp_path), "eager", cuda=False)
    assert _load_hf(tiny, "eager", cuda=False).config._attn_implementation == "eager"
    assert _load_hf(tiny, None, cuda=False).config._attn_implementation == "sdpa"


def test_fsdp_engine_takes_lora() -> None:
    """LoRA runs on the FSDP engine too (PEFT, hpcrl.engines.fsdp.lora), on a family Megatron does not
    convert as well: the preflight passes."""
    preflight(load_config(TINY, [*FSDP, "actor.lora.rank=8", "model.path=" + str(REPO / "models" / "tiny-phi3")]))


def test_fsdp_engine_takes_what_transformers_builds(tmp_path) -> None:
    """The Megatron engine refuses a family its converter does not know; the FSDP engine takes any
    causal LM transformers builds, and refuses a model_type transformers does not know."""
    phi3 = str(REPO / "models" / "tiny-phi3")
    (msg,) = problems_of(f"model.path={phi3}", "actor.parallel.tensor_parallel=1")
    assert "'Phi3ForCausalLM'" in msg and "actor.engine=fsdp" in msg
    preflight(load_config(TINY, [*FSDP, f"model.path={phi3}"]))
    # a critic on the Megatron engine beside an FSDP actor still needs a family Megatron converts
    (msg,) = problems_of(*FSDP, f"model.path={phi3}", "critic.enable=true", "critic.engine=megatron",
                         "critic.parallel.tensor_parallel=1")
    assert msg.startswith("model.path=") and "'Phi3ForCausalLM'" in msg
    odd = hf_folder(tmp_path, "odd", {"model_type": "no_such_family", "architectures": ["NoSuchForCausalLM"],
                                      "num_attention_heads": 4, "num_hidden_layers": 2})
    (msg,) = problems_of(*FSDP, f"model.path={odd}")
    assert msg.startswith("model.path=") and "transformers" in msg and "FSDP engine" in msg
