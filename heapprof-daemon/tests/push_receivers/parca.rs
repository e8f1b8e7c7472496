//! A Parca `ProfileStoreService` that takes `WriteRaw`, its messages written from
//! Parca's `proto/parca/profilestore/v1alpha1/profilestore.proto` (independently of
//! the daemon's), served as tonic's generated servers are.

use std::{
    convert::Infallible,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use tonic::codegen::{BoxFuture, Service, http};

use super::lock;

#[derive(Clone, PartialEq, prost::Message)]
pub struct WriteRawRequest {
    #[prost(string, tag = "1")]
    pub tenant: String,
    #[prost(message, repeated, tag = "2")]
    pub series: Vec<RawProfileSeries>,
    #[prost(bool, tag = "3")]
    pub normalized: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WriteRawResponse {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RawProfileSeries {
    #[prost(message, optional, tag = "1")]
    pub labels: Option<LabelSet>,
    #[prost(message, repeated, tag = "2")]
    pub samples: Vec<RawSample>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LabelSet {
    #[prost(message, repeated, tag = "1")]
    pub labels: Vec<Label>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Label {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RawSample {
    #[prost(bytes = "vec", tag = "1")]
    pub raw_profile: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    pub executable_info: Vec<ExecutableInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExecutableInfo {
    #[prost(uint32, tag = "1")]
    pub elf_type: u32,
}

/// The requests taken, each with its `authorization` metadata.
pub type ParcaTaken = Arc<Mutex<Vec<(Option<String>, WriteRawRequest)>>>;

#[derive(Clone)]
struct ProfileStore(ParcaTaken);

impl tonic::server::NamedService for ProfileStore {
    const NAME: &'static str = "parca.profilestore.v1alpha1.ProfileStoreService";
}

struct WriteRaw(ParcaTaken);

impl tonic::server::UnaryService<WriteRawRequest> for WriteRaw {
    type Response = WriteRawResponse;
    type Future = BoxFuture<tonic::Response<WriteRawResponse>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<WriteRawRequest>) -> Self::Future {
        let taken = Arc::clone(&self.0);
        Box::pin(async move {
            let auth = request
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            lock(&taken).push((auth, request.into_inner()));
            Ok(tonic::Response::new(WriteRawResponse {}))
        })
    }
}

impl<B> Service<http::Request<B>> for ProfileStore
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let taken = Arc::clone(&self.0);
        if request.uri().path() != "/parca.profilestore.v1alpha1.ProfileStoreService/WriteRaw" {
            return Box::pin(async move {
                let mut response = http::Response::new(tonic::body::Body::default());
                response.headers_mut().insert(
                    tonic::Status::GRPC_STATUS,
                    (tonic::Code::Unimplemented as i32).into(),
                );
                Ok(response)
            });
        }
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default())
                // Room for a profile of many stacks, as a Parca server allows.
                .apply_max_message_size_config(Some(64 << 20), None);
            Ok(grpc.unary(WriteRaw(taken), request).await)
        })
    }
}

/// A Parca `ProfileStoreService` on `port`, on a runtime of its own.
pub fn parca_receiver(port: u16) -> ParcaTaken {
    let taken = ParcaTaken::default();
    let service = ProfileStore(Arc::clone(&taken));
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve(([127, 0, 0, 1], port).into())
                .await
                .expect("the Parca receiver runs");
        });
    });
    taken
}
