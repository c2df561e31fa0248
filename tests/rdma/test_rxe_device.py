"""First real RDMA test: open the device, register numpy memory, and move data
between two RC QPs of this process (RDMA WRITE and SEND/RECV over loopback)."""
from __future__ import annotations

import time

import numpy as np
import pytest

pyverbs = pytest.importorskip("pyverbs")
import pyverbs.enums as e  # noqa: E402
from pyverbs.addr import AHAttr, GlobalRoute  # noqa: E402
from pyverbs.cq import CQ  # noqa: E402
from pyverbs.device import Context  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # noqa: E402
from pyverbs.wr import SGE, RecvWR, SendWR  # noqa: E402

pytestmark = pytest.mark.rdma

N = 4096
ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ


def poll(cq: CQ, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n, wcs = cq.poll(num_entries=1)
        if n:
            wc = wcs[0]
            assert wc.status == e.IBV_WC_SUCCESS, f"work completion failed: status {wc.status}"
            return wc
    pytest.fail("no work completion within %.0f s" % timeout)


def connect(qp: QP, remote_qpn: int, port: int, gid, gid_index: int, mtu):
    a = QPAttr()
    a.qp_state = e.IBV_QPS_INIT
    a.pkey_index = 0
    a.port_num = port
    a.qp_access_flags = ACCESS  # without it RDMA WRITE to this QP fails
    qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)

    a = QPAttr()
    a.qp_state = e.IBV_QPS_RTR
    a.path_mtu = mtu
    a.dest_qp_num = remote_qpn
    a.rq_psn = 0
    a.max_dest_rd_atomic = 1
    a.min_rnr_timer = 12
    a.ah_attr = AHAttr(port_num=port, is_global=1,
                       gr=GlobalRoute(dgid=gid, sgid_index=gid_index, hop_limit=64))
    qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN
              | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)

    a = QPAttr()
    a.qp_state = e.IBV_QPS_RTS
    a.timeout = 14
    a.retry_cnt = 7
    a.rnr_retry = 7
    a.sq_psn = 0
    a.max_rd_atomic = 1
    qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY
              | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC)


def test_device_and_port(rdma_device):
    dev, port, gid_index = rdma_device
    with Context(name=dev) as ctx:
        attr = ctx.query_device()
        assert attr.max_qp > 0 and attr.max_mr_size > 0
        assert isinstance(attr.fw_version, str)
        pattr = ctx.query_port(port)
        assert pattr.state == e.IBV_PORT_ACTIVE
        gid = ctx.query_gid(port, gid_index)
        assert str(gid).startswith("0000:0000:0000:0000:0000:ffff:")


def test_rc_loopback_write_and_send(rdma_device):
    dev, port, gid_index = rdma_device
    with Context(name=dev) as ctx:
        pattr = ctx.query_port(port)
        gid = ctx.query_gid(port, gid_index)
        with PD(ctx) as pd:
            src = np.arange(N, dtype=np.uint8) ^ 0x5A
            dst = np.zeros(N, dtype=np.uint8)
            rbuf = np.zeros(N, dtype=np.uint8)
            # caller memory: the zero-copy path
            src_mr = MR(pd, N, ACCESS, address=src.ctypes.data)
            dst_mr = MR(pd, N, ACCESS, address=dst.ctypes.data)
            rbuf_mr = MR(pd, N, ACCESS, address=rbuf.ctypes.data)
            cq_a, cq_b = CQ(ctx, 16), CQ(ctx, 16)
            cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
            qp_a = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq_a, rcq=cq_a, cap=cap))
            qp_b = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq_b, rcq=cq_b, cap=cap))
            connect(qp_a, qp_b.qp_num, port, gid, gid_index, pattr.active_mtu)
            connect(qp_b, qp_a.qp_num, port, gid, gid_index, pattr.active_mtu)

            # RDMA WRITE a -> b's dst
            wr = SendWR(wr_id=1, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                        sg=[SGE(src.ctypes.data, N, src_mr.lkey)],
                        send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(dst_mr.rkey, dst.ctypes.data)
            qp_a.post_send(wr)
            wc = poll(cq_a)
            assert wc.wr_id == 1
            np.testing.assert_array_equal(dst, src)

            # SEND/RECV b -> a (b sends the bytes it just received)
            qp_a.post_recv(RecvWR(wr_id=2, num_sge=1,
                                  sg=[SGE(rbuf.ctypes.data, N, rbuf_mr.lkey)]))
            qp_b.post_send(SendWR(wr_id=3, opcode=e.IBV_WR_SEND, num_sge=1,
                                  sg=[SGE(dst.ctypes.data, N, dst_mr.lkey)],
                                  send_flags=e.IBV_SEND_SIGNALED))
            assert poll(cq_b).wr_id == 3
            wc = poll(cq_a)
            assert wc.wr_id == 2 and wc.byte_len == N
            np.testing.assert_array_equal(rbuf, src)

            for o in (qp_a, qp_b, src_mr, dst_mr, rbuf_mr, cq_a, cq_b):
                o.close()
