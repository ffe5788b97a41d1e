"""Bind policy, shared token and TLS (certificates generated here), with real shard processes.

Traffic stays on loopback: the token shard binds 0.0.0.0 (allowed because it has a token) and is reached
through 127.0.0.1; the refused binds never open a socket.
"""
from __future__ import annotations

import datetime
import ipaddress
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from lightning_persia import cli
from lightning_persia.remote_ps.client import PSRequestError, RetryPolicy, ShardUnavailableError
from lightning_persia.remote_ps.protocol import AUTH_METADATA_KEY, SERVICE, bearer_metadata
from lightning_persia.remote_ps.security import BindSecurityError, check_bind_security
from lightning_persia.remote_ps.table_config import SGD, Constant, TableConfig

TOKEN = "s3cret-token"


def self_signed(directory, name: str) -> tuple[str, str]:
    """A self-signed certificate for localhost / 127.0.0.1 and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def secured(start_ps_cluster, tmp_path_factory):
    """A token shard on 0.0.0.0, a TLS shard, and a TLS shard that requires client certificates."""
    directory = tmp_path_factory.mktemp("tls")
    server_cert, server_key = self_signed(directory, "server")
    client_cert, client_key = self_signed(directory, "client")
    with ThreadPoolExecutor(3) as pool:
        token = pool.submit(start_ps_cluster, 1, host="0.0.0.0", extra_args=["--token", TOKEN])
        tls = pool.submit(start_ps_cluster, 1, extra_args=["--tls-cert", server_cert, "--tls-key", server_key])
        mtls = pool.submit(start_ps_cluster, 1, extra_args=[
            "--tls-cert", server_cert, "--tls-key", server_key, "--tls-client-ca", client_cert])
        shards = dict(token=token.result(), tls=tls.result(), mtls=mtls.result())
    port = shards["token"].addresses[0].rsplit(":", 1)[1]
    return dict(shards=shards, token_address=f"127.0.0.1:{port}", server_cert=server_cert,
                client_cert=client_cert, client_key=client_key)


def _round_trip(client, table: str) -> None:
    client.configure([TableConfig(table, 3, optimizer=SGD(lr=1.0), init=Constant(0.0))])
    ids = torch.arange(20)
    client.lookup({table: ids}, train=True)
    client.update({table: (ids, torch.ones(20, 3))})
    assert torch.equal(client.lookup({table: ids}, train=False)[table], torch.full((20, 3), -1.0))


def test_token_shard_on_all_interfaces(secured, make_client):
    assert secured["shards"]["token"].addresses[0].startswith("0.0.0.0:")
    good = make_client([secured["token_address"]], token=TOKEN)
    good.wait_healthy(10)
    _round_trip(good, "token_table")
    before = good.lookup({"token_table": torch.arange(20)}, train=False)["token_table"]

    for token, message in ((None, "missing 'authorization: Bearer <token>' metadata"), ("wrong", "wrong token")):
        bad = make_client([secured["token_address"]], token=token)
        for call in (
            lambda: bad.update({"token_table": (torch.arange(20), torch.ones(20, 3))}),
            lambda: bad.lookup({"token_table": torch.arange(100, 120)}, train=True),
            lambda: bad.configure([TableConfig("token_intruder", 2)]),
            lambda: bad.stats(),
        ):
            with pytest.raises(PSRequestError, match=message) as info:
                call()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED

    assert torch.equal(good.lookup({"token_table": torch.arange(20)}, train=False)["token_table"], before)
    stats = good.stats()[0]["tables"]
    assert stats["token_table"]["rows"] == 20 and "token_intruder" not in stats


def test_tls_with_a_self_signed_certificate(secured, make_client):
    address = secured["shards"]["tls"].addresses[0]
    client = make_client([address], tls_root_cert=secured["server_cert"])
    client.wait_healthy(10)
    _round_trip(client, "tls_table")
    plaintext = make_client([address], retry=RetryPolicy(max_retries=0, timeout_s=5))
    with pytest.raises(ShardUnavailableError, match="did not answer after 1 tries"):
        plaintext.stats()


def test_tls_with_client_certificates(secured, make_client):
    address = secured["shards"]["mtls"].addresses[0]
    with open(secured["server_cert"], "rb") as f:
        root = f.read()  # PEM bytes work as well as paths
    client = make_client([address], tls_root_cert=root, tls_client_cert=secured["client_cert"], tls_client_key=secured["client_key"])
    _round_trip(client, "mtls_table")
    anonymous = make_client([address], tls_root_cert=root, retry=RetryPolicy(max_retries=0, timeout_s=5))
    with pytest.raises((ShardUnavailableError, PSRequestError)):
        anonymous.stats()


def test_sigterm_stops_shards_gracefully(secured):
    shards = secured["shards"]["tls"]
    shards.stop()
    assert [p.returncode for p in shards.processes] == [0]
    assert "stopping" in shards.output(0)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "ps.example.com"])
def test_non_loopback_bind_without_protection_refuses_to_start(host, capsys):
    status = cli.main(["ps", "serve", "--port", "0", "--shard-index", "0", "--num-shards", "1", "--host", host])
    assert status == 2
    error = capsys.readouterr().err
    assert f"refusing to serve on non-loopback address {host!r} without protection" in error
    assert "--token" in error and "--tls-cert" in error and "--insecure" in error


def test_bind_policy():
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        check_bind_security(host, token=None, tls=False, insecure=False)
    for protection in (dict(token="t", tls=False, insecure=False), dict(token=None, tls=True, insecure=False),
                       dict(token=None, tls=False, insecure=True)):
        check_bind_security("0.0.0.0", **protection)
    with pytest.raises(BindSecurityError):
        check_bind_security("192.168.1.1", token=None, tls=False, insecure=False)


def test_every_rpc_without_or_with_a_wrong_token_is_refused_and_writes_nothing(secured, tmp_path):
    """Raw calls (no client-side checks) of every RPC: UNAUTHENTICATED, and Save/Load/Configure did nothing."""
    from lightning_persia.remote_ps.protocol import persia_pb2 as pb

    requests = {
        "Lookup": pb.LookupRequest(packed=pb.PackedIds(tables=["token_table"], counts=[1], ids=b"\0" * 8), train=True),
        "Update": pb.UpdateRequest(client_id="intruder", seq=1, packed=pb.PackedIds(tables=["token_table"], counts=[1], ids=b"\0" * 8),
                                   packed_grads=b"\0" * 12, packed_dtype=pb.FP32),
        "Configure": pb.ConfigureRequest(tables_json=['{"name": "token_intruder2", "dim": 2}']),
        "Describe": pb.DescribeRequest(),
        "Save": pb.SaveRequest(directory=str(tmp_path / "stolen")),
        "Load": pb.LoadRequest(directory=str(tmp_path / "planted")),
        "Stats": pb.StatsRequest(),
        "SaveDelta": pb.SaveDeltaRequest(directory=str(tmp_path / "stolen_delta"), save_id="x"),
        "StageDelta": pb.StageDeltaRequest(directory=str(tmp_path / "planted"), version=1),
        "CommitDelta": pb.CommitDeltaRequest(version=1),
        "GetShardMap": pb.GetShardMapRequest(),
        "Handover": pb.HandoverStep(step=pb.HandoverStep.BEGIN),
        "TakeOver": pb.TakeOverRequest(adopt=True),
    }
    assert sorted(requests) == sorted(m.name for m in SERVICE.methods)
    with grpc.insecure_channel(secured["token_address"]) as channel:
        for metadata in (None, bearer_metadata("wrong"), ((AUTH_METADATA_KEY, TOKEN),)):  # last: no "Bearer "
            for method, request in requests.items():
                with pytest.raises(grpc.RpcError) as info:
                    channel.unary_unary(f"/persia.ParameterServer/{method}")(request.SerializeToString(), timeout=10, metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, metadata)
    assert not (tmp_path / "stolen").exists() and not (tmp_path / "stolen_delta").exists()
