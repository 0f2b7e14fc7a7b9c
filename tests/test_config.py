import pytest

from fastgrpo.cli import main
from fastgrpo.config import ConfigError, flatten, load_config


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("grpo:\n  steps: 7\nrollout:\n  group_size: 4\n")
    c = load_config(f, ["rollout.temperature=0.5", "optim.betas=[0.8,0.9]"])
    assert c.grpo.steps == 7 and c.rollout.group_size == 4
    assert c.rollout.temperature == 0.5 and c.optim.betas == (0.8, 0.9)
    assert c.rollout.prompts_per_step == 8  # schema default survives
    assert flatten(c)["grpo.steps"] == 7


@pytest.mark.parametrize("override, key", [
    ("rollout.group_size=1", "rollout.group_size"),
    ("rollout.max_new_tokens=-5", "rollout.max_new_tokens"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.temperature=-0.1", "rollout.temperature"),
    ("grpo.loss_aggregation=mean", "grpo.loss_aggregation"),
    ("grpo.nonsense=1", "grpo.nonsense"),
    ("rollout.max_batch=abc", "rollout.max_batch"),
    ("model.size=huge", "model.size"),
    ("optim.trainable=norm(", "optim.trainable"),
    ("task.step_credit=1", "task.step_credit"),
    ("trainer.backend=jax", "trainer.backend"),  # the word-valued keys are Literal types
    ("speculation.policy=bogus", "speculation.policy"),
    ("draft.online=maybe", "draft.online"),
    ("device=tpu", "device"),
    ("deepspeed.zero_stage=4", "deepspeed.zero_stage"),  # checked whatever the backend
    ("parallel.tensor=2", "parallel.tensor"),  # across sections: the torch trainer runs the policy whole
    ("parallel.expert=2", "parallel.expert"),  # expert parallelism is megatron's
    ("parallel.expert=0", "parallel.expert"),
    ("parallel.expert_tensor=1", "parallel.expert_tensor"),  # megatron's expert layout: not the torch trainer's
    ("parallel.expert_tensor=-1", "parallel.expert_tensor"),  # 0 (= parallel.tensor), 1 or parallel.tensor
    ("trainer.router_aux_loss=-0.01", "trainer.router_aux_loss"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_key_in_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  gruop_size: 4\n")
    with pytest.raises(ConfigError, match="gruop_size"):
        load_config(f)


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="not found"):
        load_config("does/not/exist.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["grpo.steps"])


def test_cli_reports_config_error_before_work(tmp_path, capsys):
    rc = main(["train", "--config", str(tmp_path / "missing.yaml")])
    assert rc == 2
    assert "config file not found" in capsys.readouterr().err
    rc = main(["train", "rollout.group_size=1", f"run_dir={tmp_path}"])
    assert rc == 2
    assert "rollout.group_size" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # failed before creating anything
    # overrides are read wherever they stand on the line, also after options
    rc = main(["bench", "noise", "--output", str(tmp_path / "n.json"), "rollout.group_size=1"])
    assert rc == 2 and "rollout.group_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--no-such-flag", "rollout.group_size=4"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_off_is_a_word_on_the_command_line_and_in_files(tmp_path, capsys):
    """YAML reads a bare `off` as false; the documented spelling must still mean the mode `off`."""
    f = tmp_path / "c.yaml"
    f.write_text("speculation:\n  policy: off\ndraft:\n  online: off\n")
    c = load_config(f)
    assert c.speculation.policy == "off" and c.draft.online == "off"
    c = load_config(None, ["speculation.policy=aware", "draft.online=sync"])
    c = load_config(f, ["speculation.policy=off", "draft.online=off"])
    assert c.speculation.policy == "off" and c.draft.online == "off"
    assert load_config(None, ["speculation.policy='off'"]).speculation.policy == "off"  # the quoted form
    with pytest.raises(ConfigError, match="speculation.policy"):
        load_config(None, ["speculation.policy=true"])
    # through the command: a bad override fails with the key named, `off` passes validation
    assert main(["train", "--config", str(f), "speculation.policy=off", "draft.online=off", "grpo.steps=-1"]) == 2
    err = capsys.readouterr().err
    assert "grpo.steps" in err and "speculation.policy" not in err


def test_optimizer_offload_is_megatrons_with_the_distributed_optimizer_in_bf16():
    """trainer.optimizer_offload: megatron-core's optimizer CPU offload, refused naming the key where it
    cannot apply: another trainer (DeepSpeed's is deepspeed.offload_optimizer), no distributed
    optimizer, fp32, a CPU device."""
    megatron = ["trainer.backend=megatron", "trainer.distributed_optimizer=true", "trainer.optimizer_offload=true"]
    for backend in ("torch", "deepspeed"):
        with pytest.raises(ConfigError, match=rf"trainer\.optimizer_offload is megatron-core's optimizer CPU offload: "
                                              rf"trainer\.backend=megatron only \(trainer\.backend={backend}; "
                                              rf"DeepSpeed's ZeRO offload is deepspeed\.offload_optimizer=true\)"):
            load_config(None, [f"trainer.backend={backend}", "trainer.optimizer_offload=true"])
    with pytest.raises(ConfigError, match=r"trainer\.optimizer_offload needs trainer\.distributed_optimizer=true"):
        load_config(None, megatron + ["trainer.distributed_optimizer=false"])
    with pytest.raises(ConfigError, match=r"trainer\.optimizer_offload offloads bf16 training's optimizer"):
        load_config(None, megatron + ["trainer.precision=fp32"])
    with pytest.raises(ConfigError, match=r"trainer\.optimizer_offload moves the optimizer from GPU to host memory: "
                                          r"it needs CUDA"):
        load_config(None, megatron + ["device=cpu"])
    for precision in ("auto", "bf16"):
        assert load_config(None, megatron + [f"trainer.precision={precision}"]).trainer.optimizer_offload
    assert not load_config(None, ["trainer.backend=megatron"]).trainer.optimizer_offload  # off by default


def test_every_shipped_config_loads_and_is_in_the_docs():
    """docs/config.md's table names every file of configs/ (a config nobody can find is not shipped), and
    each one loads and validates."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "config.md").read_text()
    shipped = sorted((root / "configs").glob("*.yaml"))
    assert len(shipped) >= 9
    for path in shipped:
        assert f"`configs/{path.name}`" in docs, path.name
        load_config(path)
