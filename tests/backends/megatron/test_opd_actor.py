"""On-policy distillation on a real train rank (opd_actor.py, fp32 on CPU): a Megatron teacher from
--opd-teacher-load at --opd-teacher-ckpt-step scores the student's responses exactly as a separate forward of that
checkpoint does, the advantages move by -opd_kl_coef * (student - teacher) per token, a teacher equal to the student
moves nothing, the teacher is frozen and parked by colocated offload, and a teacher of another vocabulary or
architecture is refused naming --opd-teacher-load."""

from script_rows import rows_by_case, run_script


def test_megatron_teacher_penalises_the_advantages(tiny_kit, tmp_path):
    run_script("opd_actor.py", tiny_kit.model_dir, tmp_path, "teacher", timeout=600)
    rows = rows_by_case(run_script("opd_actor.py", tiny_kit.model_dir, tmp_path, "opd", timeout=600))
    same, trained, train, refusals = (rows[k] for k in ("teacher is student", "trained teacher", "train", "refusals"))
    # teacher = the student's starting weights: the advantages are the estimator's, the reverse KL 0
    assert same["gap"] == 0.0 and same["reverse_kl"] == 0.0 and same["base_nonzero"] > 0.1, same
    # teacher = the trained iteration 1: A - 0.5 * (old - teacher), with the teacher of a separate forward
    assert trained["gap"] < 1e-5 and trained["shift"] > 1e-3, trained
    assert abs(trained["teacher_log_probs"] - trained["teacher_mean"]) < 1e-5, trained
    assert abs(trained["reverse_kl"] - trained["kl_mean"]) < 1e-5 and abs(trained["kl_mean"]) > 1e-3, trained
    assert train["train_reverse_kl"] == train["rollout_reverse_kl"] and train["grad_norm"] > 0, train
    assert train["teacher_slots"] == train["teacher_tensors"] > 0 and train["teacher_trainable"] == 0, train
    assert "checkpoint.opd_teacher_load" in refusals["vocab"] and "999" in refusals["vocab"], refusals
    assert "checkpoint.opd_teacher_load" in refusals["layers"] and "num_layers" in refusals["layers"], refusals
