"""A local S3 server (moto) for tests of the store on s3://; importable from any test directory."""


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
