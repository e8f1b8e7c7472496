//! A unary gRPC call whose request is already encoded: the OTLP export is put
//! together as bytes (see `otlp`), never as one message, so the call sends those
//! bytes as they are and decodes the answer with prost.

use std::marker::PhantomData;

use bytes::{Buf as _, BufMut as _, Bytes};
use tonic::{
    Status,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    codegen::http::uri::PathAndQuery,
    transport::Channel,
};

/// OTLP's `ProfilesService/Export`.
pub const OTLP_EXPORT: &str =
    "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export";

/// Calls `path` on `channel` with the encoded request in `request`, answered by an `R`.
pub async fn call<R: prost::Message + Default + Send + Sync + 'static>(
    channel: &Channel,
    path: &'static str,
    request: tonic::Request<Bytes>,
) -> Result<R, Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready()
        .await
        .map_err(|err| Status::unavailable(err.to_string()))?;
    let codec = Encoded::<R>(PhantomData);
    let response = grpc
        .unary(request, PathAndQuery::from_static(path), codec)
        .await?;
    Ok(response.into_inner())
}

/// Sends bytes as they are, decodes an `R`.
struct Encoded<R>(PhantomData<R>);

impl<R: prost::Message + Default + Send + 'static> Codec for Encoded<R> {
    type Encode = Bytes;
    type Decode = R;
    type Encoder = Self;
    type Decoder = Self;

    fn encoder(&mut self) -> Self {
        Encoded(PhantomData)
    }

    fn decoder(&mut self) -> Self {
        Encoded(PhantomData)
    }
}

impl<R> Encoder for Encoded<R> {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl<R: prost::Message + Default> Decoder for Encoded<R> {
    type Item = R;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<R>, Status> {
        let bytes = src.copy_to_bytes(src.remaining());
        R::decode(bytes)
            .map(Some)
            .map_err(|err| Status::internal(format!("the answer does not decode: {err}")))
    }
}
