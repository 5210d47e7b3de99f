//! SIGTERM/SIGINT as a value every wait of the relay can race against, so a signal ends
//! every mode within a bounded time whatever the consumer does.

use std::future::Future;

use tokio::sync::watch;

/// Whether a stop was asked for; cheap to clone and to check.
#[derive(Clone, Debug)]
pub struct Stop {
    asked: watch::Receiver<bool>,
}

impl Stop {
    /// A stop that `shutdown` (e.g. the signal future) asks for when it completes.
    pub fn on(shutdown: impl Future<Output = ()> + Send + 'static) -> Stop {
        let (tx, asked) = watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = tx.send(true);
        });
        Stop { asked }
    }

    /// True once the stop was asked for.
    pub fn requested(&self) -> bool {
        *self.asked.borrow()
    }

    /// Completes once the stop is asked for; pending for ever if it never is.
    pub async fn asked(&self) {
        let mut asked = self.asked.clone();
        if asked.wait_for(|s| *s).await.is_err() {
            // The shutdown future ended without asking (it cannot: it sends first).
            std::future::pending::<()>().await;
        }
    }
}
