import pytest

from slime.types import Sample


def moto_s3_options(bucket: str, **extra):
    """A moto S3 server on 127.0.0.1 with `bucket` created: yields fsspec s3 options for it (plus `extra`)
    and stops the server after. Use it as the body of a module-scoped fixture."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    creds = {"aws_access_key_id": "test", "aws_secret_access_key": "test", "region_name": "us-east-1"}
    boto3.client("s3", endpoint_url=endpoint, **creds).create_bucket(Bucket=bucket)
    yield {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
           **extra}
    server.stop()


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
