"""MinIO bucket init (the rollpacker-minio-init Job, controller image): wait for MinIO, create the
bucket, then rollpacker's own S3 user with a policy limited to that bucket. Idempotent.

Environment: MINIO_ENDPOINT (host:port), BUCKET, MINIO_ROOT_USER / MINIO_ROOT_PASSWORD (the admin),
ROLLPACKER_S3_ACCESS_KEY / ROLLPACKER_S3_SECRET_KEY (the user to create), MINIO_SECURE=1 for https,
INIT_TIMEOUT_S (default 300). `--bucket-only` skips the user (S3 servers without MinIO's admin API).
"""

from __future__ import annotations

import os
import sys
import time

POLICY = "rollpacker-bucket"
REQUIRED = ("MINIO_ENDPOINT", "BUCKET", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD")
USER_VARS = ("ROLLPACKER_S3_ACCESS_KEY", "ROLLPACKER_S3_SECRET_KEY")


def bucket_policy(bucket: str) -> dict[str, object]:
    """Read/write/list on ``bucket`` and nothing else."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": ["s3:GetBucketLocation", "s3:ListBucket", "s3:ListBucketMultipartUploads"],
                "Resource": [f"arn:aws:s3:::{bucket}"],
            },
            {
                "Effect": "Allow",
                "Action": [
                    "s3:GetObject",
                    "s3:PutObject",
                    "s3:DeleteObject",
                    "s3:AbortMultipartUpload",
                    "s3:ListMultipartUploadParts",
                ],
                "Resource": [f"arn:aws:s3:::{bucket}/*"],
            },
        ],
    }


def main(argv: list[str]) -> int:
    bucket_only = "--bucket-only" in argv
    need = REQUIRED + (() if bucket_only else USER_VARS)
    missing = [k for k in need if not os.environ.get(k)]
    if missing:
        print(
            f"error: set {', '.join(missing)} (the Secrets rollpacker-minio / rollpacker-s3)", file=sys.stderr
        )
        return 2
    import urllib3
    from minio import Minio
    from minio.credentials import StaticProvider
    from minio.minioadmin import MinioAdmin

    env = os.environ
    secure = env.get("MINIO_SECURE", "") == "1"
    # one try per call: the loop below waits for MinIO, the Job's backoffLimit retries the rest
    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5, read=60), retries=urllib3.Retry(total=0))
    client = Minio(
        env["MINIO_ENDPOINT"],
        env["MINIO_ROOT_USER"],
        env["MINIO_ROOT_PASSWORD"],
        secure=secure,
        http_client=http,
    )
    deadline = time.monotonic() + float(env.get("INIT_TIMEOUT_S", "300"))
    while True:
        try:
            exists = client.bucket_exists(env["BUCKET"])
            break
        except Exception as e:  # connection refused while MinIO starts, ...
            if time.monotonic() > deadline:
                print(f"error: MinIO at {env['MINIO_ENDPOINT']} did not answer: {e}", file=sys.stderr)
                return 1
            time.sleep(2)
    if not exists:
        client.make_bucket(env["BUCKET"])
    print(f"bucket {env['BUCKET']}: {'present' if exists else 'created'}")
    if bucket_only:
        return 0
    admin = MinioAdmin(
        endpoint=env["MINIO_ENDPOINT"],
        credentials=StaticProvider(env["MINIO_ROOT_USER"], env["MINIO_ROOT_PASSWORD"]),
        secure=secure,
    )
    admin.policy_add(POLICY, policy=bucket_policy(env["BUCKET"]))
    admin.user_add(env["ROLLPACKER_S3_ACCESS_KEY"], env["ROLLPACKER_S3_SECRET_KEY"])
    admin.policy_set(POLICY, user=env["ROLLPACKER_S3_ACCESS_KEY"])
    print(f"rollpacker S3 user: policy {POLICY} on bucket {env['BUCKET']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
