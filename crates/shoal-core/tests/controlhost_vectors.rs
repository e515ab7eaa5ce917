//! Replays every vector of `controlhost_vectors.json` (captured from the real PyPI
//! `controlhost` 0.7.1 and `km3pipe` 11.0.0 clients, or derived from source; copied from
//! the design notes) through the codec and the router.

use bytes::Bytes;
use serde_json::Value;
use shoal_core::controlhost::{Message, MessageDecoder, Output, Router, RouterConfig, Tag, encode_prefix};

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn vectors() -> Vec<Value> {
    let text = include_str!("data/controlhost_vectors.json");
    let v: Value = serde_json::from_str(text).unwrap();
    v["vectors"].as_array().unwrap().clone()
}

fn decode_all(bytes: &[u8]) -> (Vec<Message>, MessageDecoder) {
    let mut d = MessageDecoder::new(64 << 20);
    d.extend(bytes);
    let mut out = Vec::new();
    while let Some(m) = d.next_message().unwrap() {
        out.push(m);
    }
    (out, d)
}

#[test]
fn every_framed_vector_decodes_to_its_frames_and_reencodes() {
    let mut checked = 0;
    for v in vectors() {
        let name = v["name"].as_str().unwrap();
        let Some(frames) = v["frames"].as_array().filter(|f| !f.is_empty()) else { continue };
        let bytes = unhex(v["hex"].as_str().unwrap());
        let (msgs, d) = decode_all(&bytes);
        assert!(d.finish().is_ok(), "{name}: bytes left over");
        assert_eq!(msgs.len(), frames.len(), "{name}");
        let mut reencoded = Vec::new();
        for (m, f) in msgs.iter().zip(frames) {
            assert_eq!(m.tag, Tag::new(f["tag"].as_str().unwrap().as_bytes()).unwrap(), "{name}");
            assert_eq!(m.payload.len() as u64, f["length"].as_u64().unwrap(), "{name}");
            assert_eq!(m.payload.to_vec(), unhex(f["payload_hex"].as_str().unwrap()), "{name}");
            reencoded.extend_from_slice(&encode_prefix(m.tag, m.payload.len()));
            reencoded.extend_from_slice(&m.payload);
        }
        // We always write zero padding; only the non-zero-padding case differs.
        if name == "prefix_nonzero_pad" {
            assert_ne!(reencoded, bytes);
            assert_eq!(&reencoded[..12], &bytes[..12]);
            assert_eq!(&reencoded[16..], &bytes[16..]);
        } else {
            assert_eq!(reencoded, bytes, "{name}: our encoding must be byte-identical");
        }
        checked += 1;
    }
    assert_eq!(checked, 21);
}

#[test]
fn legacy_12_byte_prefix_is_not_mistaken_for_a_message() {
    let v = vectors().into_iter().find(|v| v["name"] == "legacy_caspur_12byte_prefix").unwrap();
    let (msgs, d) = decode_all(&unhex(v["hex"].as_str().unwrap()));
    assert!(msgs.is_empty(), "the 16-byte dialect must not deliver a legacy frame");
    assert!(d.finish().is_err(), "it is left as a truncated message");
}

/// Feeds a client's vectors into a router and returns its final subscription text.
fn final_subscription(names: &[&str]) -> String {
    let all = vectors();
    let mut r = Router::new(RouterConfig::default());
    r.handle_connect(1);
    for name in names {
        let v = all.iter().find(|v| v["name"] == *name).unwrap();
        for m in decode_all(&unhex(v["hex"].as_str().unwrap())).0 {
            r.handle_message(1, m);
        }
    }
    r.status()[0].subscription.clone()
}

#[test]
fn client_subscription_sequences_end_in_the_expected_set() {
    assert_eq!(final_subscription(&["controlhost071_whole_session"]), "w IO_EVT");
    assert_eq!(final_subscription(&["km3pipe_subscribe_any", "km3pipe_subscribe_add_all"]), "w IO_EVT a IO_SUM");
    assert_eq!(final_subscription(&["km3pipe_subscribe_add_all", "km3pipe_unsubscribe_to_empty"]), "");
    assert_eq!(final_subscription(&["km3pipe_subscribe_two_tags_one_mode"]), "w IO_EVT w IO_SUM");
    assert_eq!(final_subscription(&["km3pipe_chpump_connect"]), "w IO_EVT w IO_SUM");
    assert_eq!(final_subscription(&["km3iojl_subscribe_chtag"]), "w IO_EVT");
    // Replace semantics: KM3io.jl's per-tag subscriptions keep only the last one.
    assert_eq!(final_subscription(&["km3iojl_two_tags"]), "w IO_SUM");
}

#[test]
fn dispatcher_to_client_vectors_are_what_the_router_emits() {
    let all = vectors();
    let hex = |name: &str| unhex(all.iter().find(|v| v["name"] == name).unwrap()["hex"].as_str().unwrap());
    let frame = |o: &Output| match o {
        Output::Transmit { message, .. } => {
            let mut b = encode_prefix(message.tag, message.payload.len()).to_vec();
            b.extend_from_slice(&message.payload);
            b
        }
        other => panic!("unexpected {other:?}"),
    };
    let mut r = Router::new(RouterConfig::default());
    r.handle_connect(1);
    r.handle_connect(2);
    for m in decode_all(&hex("km3pipe_chpump_connect")).0 {
        r.handle_message(1, m);
    }
    r.handle_message(
        2,
        Message { tag: Tag::new(b"IO_EVT").unwrap(), payload: Bytes::from_static(&[0xde, 0xad, 0xbe, 0xef]) },
    );
    let out: Vec<_> = std::iter::from_fn(|| r.poll_output()).collect();
    assert_eq!(out.len(), 1);
    assert_eq!(frame(&out[0]), hex("dispatcher_to_client_io_evt"));

    // Two MSG publications relayed to a raw tap.
    let relay = hex("relay_delivered_two_msg_frames");
    let (sent, _) = decode_all(&relay);
    let mut r = Router::new(RouterConfig::default());
    r.handle_connect(1);
    r.handle_connect(2);
    r.handle_message(1, Message { tag: Tag::SUBSCRIBE, payload: Bytes::from_static(b" w MSG") });
    r.handle_message(1, Message { tag: Tag::ALWAYS, payload: Bytes::new() });
    for m in sent {
        r.handle_message(2, m);
    }
    let bytes: Vec<u8> = std::iter::from_fn(|| r.poll_output()).flat_map(|o| frame(&o)).collect();
    assert_eq!(bytes, relay);

    // _MyId from the vector produces the Born announcement vector.
    let mut r = Router::new(RouterConfig::default());
    r.handle_connect(1);
    r.handle_connect(2);
    r.handle_message(1, Message { tag: Tag::SUBSCRIBE, payload: Bytes::from_static(b"w Born") });
    r.handle_message(1, Message { tag: Tag::ALWAYS, payload: Bytes::new() });
    for m in decode_all(&hex("control_myid")).0 {
        r.handle_message(2, m);
    }
    let out: Vec<_> = std::iter::from_fn(|| r.poll_output()).collect();
    assert_eq!(frame(&out[0]), hex("announce_born"));
}
