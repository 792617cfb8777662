//! The queue between the producer and the writer thread, bounded in bytes.
//!
//! A row's size is what it holds while it waits ([`Record::approx_bytes`]):
//! a bound in rows is no bound at all when one top-k row holds two 2048-long
//! lists and one hidden row a few numbers. A row that does not fit waits for
//! room until its deadline (blocking) or is refused at once (lossy); either
//! way the producer never waits forever. One message larger than the whole
//! bound still passes an empty queue: the bound limits what waits, not what
//! a single capture may be.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::Message;

/// What [`ByteQueue::pop`] found.
#[expect(
    clippy::large_enum_variant,
    reason = "a message is what is nearly always found; boxing would allocate once more per row"
)]
pub(crate) enum Popped {
    Message(Message),
    Idle,
    Closed,
}

struct State {
    messages: VecDeque<(Message, usize)>,
    bytes: usize,
    closed: bool,
}

pub(crate) struct ByteQueue {
    capacity: usize,
    state: Mutex<State>,
    room: Condvar,
    ready: Condvar,
}

impl ByteQueue {
    pub(crate) fn new(capacity: usize) -> ByteQueue {
        ByteQueue {
            capacity,
            state: Mutex::new(State {
                messages: VecDeque::new(),
                bytes: 0,
                closed: false,
            }),
            room: Condvar::new(),
            ready: Condvar::new(),
        }
    }

    /// Queues `message` (`bytes` in size), waiting for room until `deadline`
    /// (`None`: not at all); false, and the message dropped, when it did not
    /// fit in time or the queue is closed.
    #[must_use]
    pub(crate) fn push(&self, message: Message, bytes: usize, deadline: Option<Instant>) -> bool {
        // A poisoned lock means the writer thread panicked holding it; its state is a
        // queue of plain values, still consistent, and the panic is reported at close.
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if state.closed {
                return false;
            }
            if state.messages.is_empty() || state.bytes + bytes <= self.capacity {
                state.bytes += bytes;
                state.messages.push_back((message, bytes));
                self.ready.notify_one();
                return true;
            }
            let Some(left) = deadline.and_then(|d| d.checked_duration_since(Instant::now())) else {
                return false;
            };
            state = self
                .room
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// The next message, waiting for one at most `wait`: [`Popped::Idle`] when
    /// none came, [`Popped::Closed`] once the queue is closed and empty.
    pub(crate) fn pop(&self, wait: Duration) -> Popped {
        let deadline = Instant::now() + wait;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some((message, bytes)) = state.messages.pop_front() {
                state.bytes -= bytes;
                self.room.notify_all();
                return Popped::Message(message);
            }
            if state.closed {
                return Popped::Closed;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Popped::Idle;
            };
            state = self
                .ready
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// No more messages are accepted; those queued are still handed out.
    pub(crate) fn close(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.closed = true;
        self.ready.notify_all();
        self.room.notify_all();
    }
}
