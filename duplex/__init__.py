"""Model-neutral duplex session core: contracts, sessions, turns, epochs and barge-in.

Nothing here imports MLX, websockets, `engine` or `gateway`: the core talks to the
engine only through a `DuplexStreamingStagePort` and to the client only through the
values it returns.

- `duplex.contracts`: value types, the `DuplexStagePort` ABC and the request-id codec.
- `duplex.outputs`: `DuplexStageOutput` and `DuplexStreamingStagePort`.
- `duplex.session`: `DuplexSession`, the sans-I/O state machine (`duplex.state` holds
  its transition table, `duplex.actions` the actions it returns).
- `duplex.events`: what a session's consumer reads (`TurnOutput`, `TurnDone`, ...).
- `duplex.appends`: what the session's resident stage-0 request hears (audio frames,
  utterance starts and ends, live-transcription options), as append plans.
- `duplex.manager`: `DuplexSessionManager`, the asyncio shell over a stage port.
"""

from duplex.contracts import DuplexAppendPlan, DuplexFence
from duplex.errors import (
    DuplexBackpressureError,
    DuplexCapacityError,
    DuplexError,
    DuplexSessionExistsError,
    DuplexStateError,
)
from duplex.events import DuplexEvent, SessionClosed, SessionOpened, TurnDone, TurnOutput
from duplex.manager import DuplexSessionHandle, DuplexSessionManager
from duplex.outputs import DuplexStageOutput, DuplexStreamingStagePort
from duplex.session import DuplexSession

__all__ = [
    "DuplexAppendPlan",
    "DuplexBackpressureError",
    "DuplexCapacityError",
    "DuplexError",
    "DuplexEvent",
    "DuplexFence",
    "DuplexSession",
    "DuplexSessionExistsError",
    "DuplexSessionHandle",
    "DuplexSessionManager",
    "DuplexStageOutput",
    "DuplexStateError",
    "DuplexStreamingStagePort",
    "SessionClosed",
    "SessionOpened",
    "TurnDone",
    "TurnOutput",
]
