"""Names for the status values events carry.

Verbs statuses use libibverbs' own names (``enum ibv_wc_status``, a stable ABI),
so this module needs no pyverbs and the TCP transport and tests share them.
"""

from __future__ import annotations

OK = "OK"
# Our own deadline fired: WRs were outstanding and nothing completed within the
# transport's op_timeout (the NIC's retry timer may never fire, see RECIPE.md).
TIMEOUT = "TIMEOUT"
# The link was released or the transport closed while the transfer was queued.
CANCELLED = "CANCELLED"
# ibv_post_send refused WRs (a bug or exhausted resources; the SQ is never overfilled).
POST_SEND_FAILED = "POST_SEND_FAILED"
# The transport's loop hit an unexpected error on this link (logged with a traceback).
INTERNAL_ERROR = "INTERNAL_ERROR"
# TCP only: the connection to the peer broke (reset, EOF, send/recv error).
TCP_CONNECTION_LOST = "TCP_CONNECTION_LOST"
# TCP only: the receiver refused a block outside its remote-writable regions
# (the TCP twin of IBV_WC_REM_ACCESS_ERR).
TCP_REMOTE_ACCESS_ERR = "TCP_REMOTE_ACCESS_ERR"

_WC_STATUS = (
    "IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_EEC_OP_ERR",
    "IBV_WC_LOC_PROT_ERR", "IBV_WC_WR_FLUSH_ERR", "IBV_WC_MW_BIND_ERR", "IBV_WC_BAD_RESP_ERR",
    "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR",
    "IBV_WC_REM_OP_ERR", "IBV_WC_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR",
    "IBV_WC_LOC_RDD_VIOL_ERR", "IBV_WC_REM_INV_RD_REQ_ERR", "IBV_WC_REM_ABORT_ERR",
    "IBV_WC_INV_EECN_ERR", "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR",
    "IBV_WC_RESP_TIMEOUT_ERR", "IBV_WC_GENERAL_ERR", "IBV_WC_TM_ERR",
    "IBV_WC_TM_RNDV_INCOMPLETE",
)
_QP_STATE = ("IBV_QPS_RESET", "IBV_QPS_INIT", "IBV_QPS_RTR", "IBV_QPS_RTS", "IBV_QPS_SQD",
             "IBV_QPS_SQE", "IBV_QPS_ERR", "IBV_QPS_UNKNOWN")


def wc_status_name(status: int) -> str:
    """``enum ibv_wc_status`` value to its name, e.g. 12 -> IBV_WC_RETRY_EXC_ERR."""
    return _WC_STATUS[status] if 0 <= status < len(_WC_STATUS) else f"IBV_WC_STATUS_{status}"


def qp_state_name(state: int) -> str:
    """``enum ibv_qp_state`` value to its name, e.g. 6 -> IBV_QPS_ERR."""
    return _QP_STATE[state] if 0 <= state < len(_QP_STATE) else f"IBV_QPS_{state}"
