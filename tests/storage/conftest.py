import pytest
from s3_server import moto_s3_options  # noqa: F401  (test modules import it from here)

from slime.types import Sample


def make_samples(n: int, *, start: int = 0, seed: int = 0) -> list[Sample]:
    """Samples exercising every column: message prompts, dict rewards, null lists, unicode."""
    import numpy as np

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(start, start + n):
        prompt_len, resp_len = int(rng.integers(1, 20)), int(rng.integers(0, 30))
        tokens = rng.integers(0, 150_000, prompt_len + resp_len).tolist()
        logp = (-rng.random(resp_len)).astype(np.float32).tolist()  # float32-representable values
        samples.append(
            Sample(
                group_index=i // 4,
                index=i,
                prompt="Σ 12+3 = ?" if i % 3 else [{"role": "user", "content": f"q{i}"}],
                tokens=tokens,
                response=f"answer {i} ✓",
                response_length=resp_len,
                label=str(i) if i % 5 else {"answer": i, "alts": [i, -i]},
                reward=None if i % 7 == 0 else ({"score": 1.0, "acc": True} if i % 2 else float(i) / 3),
                loss_mask=rng.integers(0, 2, resp_len).tolist() if i % 6 else None,
                weight_versions=[str(v) for v in range(i % 3)],
                rollout_log_probs=logp if i % 4 else None,
                rollout_routed_experts=[[1, 2], [3]] if i % 9 == 0 else None,
                remove_sample=i % 8 == 0,
                teacher_log_probs=logp if i % 10 == 0 else None,
                status=list(Sample.Status)[i % 5],
                metadata={"i": i, "tags": ["x"], "nested": {"a": None}},
                train_metadata={"loss": "sft"} if i % 11 == 0 else None,
                session_id=f"s{i}" if i % 2 else None,
                non_generation_time=i * 0.125,
            )
        )
        samples[-1].spec_info.spec_verify_ct = i
        samples[-1].prefix_cache_info.cached_tokens = 2 * i
    return samples


@pytest.fixture
def samples():
    return make_samples(64)
