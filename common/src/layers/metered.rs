//! The frame of a metrics layer: a [`Meter`] sees each request arrive, its answer's head, and once
//! the answer has ended, how its body ended and how long it all took (a stream's duration is its
//! body's; gRPC's status comes in its trailers). [`Observed`] is the body that says how it ended.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Instant,
};

use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

/// What a metrics layer records, in three steps: what it keeps of a request as it arrives, of its
/// answer's head, and then the record, once the answer's body has ended.
pub trait Meter: Clone {
    type Call: Send + 'static;
    type Answer: Send + 'static;
    fn start<B>(&self, request: &Request<B>) -> Self::Call;
    fn answered(call: Self::Call, status: StatusCode, headers: &HeaderMap) -> Self::Answer;
    /// `seconds` since the request arrived.
    fn finished(answer: Self::Answer, end: End<'_>, seconds: f64);
}

/// Meters every request of the service it wraps with `M`.
#[derive(Clone, Copy, Debug, Default)]
pub struct MeterLayer<M>(pub M);

impl<S, M: Meter> Layer<S> for MeterLayer<M> {
    type Service = Metered<S, M>;

    fn layer(&self, inner: S) -> Metered<S, M> {
        Metered { inner, meter: self.0.clone() }
    }
}

#[derive(Clone, Debug)]
pub struct Metered<S, M> {
    inner: S,
    meter: M,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, M, ReqBody, ResBody> Service<Request<ReqBody>> for Metered<S, M>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    M: Meter,
    ResBody: Body + Send + 'static,
{
    type Response = Response<Observed<ResBody>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let call = self.meter.start(&request);
        let started = Instant::now();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            let answer = M::answered(call, response.status(), response.headers());
            Ok(response
                .map(|body| Observed::new(body, move |end| M::finished(answer, end, started.elapsed().as_secs_f64()))))
        })
    }
}

/// How a body ended.
pub enum End<'a> {
    /// Sent to its end; gRPC's trailers when it had them.
    Finished(Option<&'a HeaderMap>),
    /// The body itself failed mid-way.
    Failed,
    /// Dropped before its end: the client went away (or the connection broke).
    Dropped,
}

type OnEnd = Box<dyn for<'a> FnOnce(End<'a>) + Send>;

pin_project! {
    /// `inner`, reporting its end to `on_end` exactly once.
    pub struct Observed<B: Body> {
        #[pin]
        inner: B,
        on_end: Option<OnEnd>,
    }

    impl<B: Body> PinnedDrop for Observed<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(on_end) = this.on_end.take() {
                // An empty body (a trailers-only gRPC answer) is never polled.
                on_end(if this.inner.is_end_stream() { End::Finished(None) } else { End::Dropped });
            }
        }
    }
}

impl<B: Body> Observed<B> {
    pub fn new(inner: B, on_end: impl for<'a> FnOnce(End<'a>) + Send + 'static) -> Self {
        Observed { inner, on_end: Some(Box::new(on_end)) }
    }
}

impl<B: Body> Body for Observed<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let mut this = self.project();
        let polled = ready!(this.inner.as_mut().poll_frame(cx));
        let end = match &polled {
            Some(Ok(frame)) => frame.trailers_ref().map(|trailers| End::Finished(Some(trailers))),
            Some(Err(_)) => Some(End::Failed),
            None => Some(End::Finished(None)),
        };
        if let Some(end) = end {
            if let Some(on_end) = this.on_end.take() {
                on_end(end);
            }
        } else if this.inner.is_end_stream() {
            // hyper stops polling a body that says it has ended: its last data frame is its end.
            if let Some(on_end) = this.on_end.take() {
                on_end(End::Finished(None));
            }
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
