//! SGLang's native `/generate` as this crate uses it: the request of one group, and the checks
//! that turn its reply into [`Generation`]s or an error naming the field.
//!
//! One request per group: the prompt's token ids once, `sampling_params.n` = the group size. The
//! server prefills the prompt once and forks its samples (it answers with a list of `n`
//! outputs, in order), the rows of a group stay on one server (its prefix cache), and groups
//! spread over the servers and the concurrency limit.

use conrub_rollout::{Decoding, FinishReason, Generation, SamplingConfig, SamplingParams};
use serde_json::{json, Value};

use crate::error::RemoteError;

/// The body of one group's `/generate` call.
pub fn generate_body(prompt: &[u32], n: usize, sampling: &SamplingConfig) -> Value {
    let (temperature, top_p, top_k, min_p) = match sampling.decoding {
        // SGLang decodes greedily below a temperature of 1e-6.
        Decoding::Greedy => (0.0, 1.0, -1i64, 0.0),
        Decoding::Sample(SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            ..
        }) => (temperature, top_p, top_k.map_or(-1, |k| k as i64), min_p),
    };
    // SGLang's own rule (its penalizers since the 0.4 series) penalizes the ids of the new
    // tokens, not the prompt's as the in-process engines and Hugging Face do.
    let repetition_penalty = sampling.decoding.repetition_penalty();
    json!({
        "input_ids": prompt,
        "sampling_params": {
            "n": n,
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
            "stop_token_ids": sampling.stop_ids,
            // The stop token stays in `output_ids`, as the learner's rows keep it.
            "no_stop_trim": true,
            "skip_special_tokens": false,
        },
        "return_logprob": true,
        "logprob_start_len": -1,
    })
}

/// What a reply is checked against.
pub struct Expect<'a> {
    /// The server's URL (for errors).
    pub url: &'a str,
    /// Outputs wanted (the group size).
    pub n: usize,
    /// The policy's vocabulary size: every id must be below it.
    pub vocab_size: usize,
    /// Sampling settings of the request (length limit, stop ids).
    pub sampling: &'a SamplingConfig,
    /// The weight version the server must report where it reports one.
    pub weight_version: Option<&'a str>,
}

/// The `n` generations of a group's reply, or an error naming the field that is wrong.
pub fn parse_group(reply: &Value, e: &Expect<'_>) -> Result<Vec<Generation>, RemoteError> {
    let bad = |field: String, message: String| RemoteError::Reply {
        url: e.url.to_string(),
        field,
        message,
    };
    let outputs: Vec<&Value> = match reply {
        Value::Array(a) => a.iter().collect(),
        Value::Object(_) => vec![reply],
        _ => return Err(bad("(body)".into(), "neither a list nor an object".into())),
    };
    if outputs.len() != e.n {
        return Err(bad(
            "(body)".into(),
            format!("{} outputs for n = {}", outputs.len(), e.n),
        ));
    }
    outputs
        .iter()
        .enumerate()
        .map(|(i, o)| parse_output(o, i, e))
        .collect()
}

/// Output `i` of a reply, or an error naming its field that is wrong.
fn parse_output(o: &Value, i: usize, e: &Expect<'_>) -> Result<Generation, RemoteError> {
    let field = |f: &str, message: String| RemoteError::Reply {
        url: e.url.to_string(),
        field: format!("[{i}].{f}"),
        message,
    };
    let ids = o
        .get("output_ids")
        .and_then(Value::as_array)
        .ok_or_else(|| field("output_ids", "missing or not a list".into()))?;
    let tokens: Vec<u32> = ids
        .iter()
        .enumerate()
        .map(|(t, v)| match v.as_u64() {
            Some(id) if (id as usize) < e.vocab_size => Ok(id as u32),
            Some(id) => Err(field(
                &format!("output_ids[{t}]"),
                format!("id {id} is outside the vocabulary of {}", e.vocab_size),
            )),
            None => Err(field(
                &format!("output_ids[{t}]"),
                format!("{v} is not an id"),
            )),
        })
        .collect::<Result<_, _>>()?;
    let meta = o
        .get("meta_info")
        .ok_or_else(|| field("meta_info", "missing".into()))?;
    if let (Some(want), Some(got)) = (e.weight_version, meta.get("weight_version")) {
        if got.as_str() != Some(want) {
            return Err(field(
                "meta_info.weight_version",
                format!("{got} but the weights sent last are {want:?}: a reply from stale weights"),
            ));
        }
    }
    let lps = meta
        .get("output_token_logprobs")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            field(
                "meta_info.output_token_logprobs",
                "missing or not a list".into(),
            )
        })?;
    if lps.len() != tokens.len() {
        return Err(field(
            "meta_info.output_token_logprobs",
            format!("{} entries for {} output ids", lps.len(), tokens.len()),
        ));
    }
    let mut logprobs = Vec::with_capacity(tokens.len());
    for (t, (entry, id)) in lps.iter().zip(&tokens).enumerate() {
        let f = format!("meta_info.output_token_logprobs[{t}]");
        let lp = entry.get(0).and_then(Value::as_f64);
        let tid = entry.get(1).and_then(Value::as_u64);
        match (lp, tid) {
            (Some(lp), Some(tid)) if tid == *id as u64 && lp.is_finite() && lp <= 1e-3 => {
                logprobs.push(lp as f32)
            }
            (Some(_), Some(tid)) if tid != *id as u64 => {
                return Err(field(&f, format!("token {tid} but output_ids has {id}")))
            }
            _ => {
                return Err(field(
                    &f,
                    format!("{entry} is not [log-prob <= 0, token id, ..]"),
                ))
            }
        }
    }
    let reason = meta
        .get("finish_reason")
        .ok_or_else(|| field("meta_info.finish_reason", "missing".into()))?;
    let kind = reason.get("type").and_then(Value::as_str).unwrap_or("");
    let max = e.sampling.max_new_tokens;
    let f = "meta_info.finish_reason";
    if tokens.len() > max {
        return Err(field(
            f,
            format!("{} tokens, over max_new_tokens {max}", tokens.len()),
        ));
    }
    let finish_reason = match kind {
        "stop" => match tokens.last() {
            Some(last) if e.sampling.stop_ids.contains(last) => FinishReason::Stop,
            last => {
                return Err(field(
                    f,
                    format!("stop, but the last token {last:?} is none of the stop ids"),
                ))
            }
        },
        "length" if tokens.len() == max => FinishReason::Length,
        "length" => {
            return Err(field(
                f,
                format!("length, after {} of {max} tokens", tokens.len()),
            ))
        }
        "abort" => {
            let why = reason.get("message").cloned().unwrap_or(Value::Null);
            return Err(field(f, format!("the server aborted the request: {why}")));
        }
        _ => return Err(field(f, format!("{reason} is not stop or length"))),
    };
    Ok(Generation {
        tokens,
        logprobs,
        finish_reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling() -> SamplingConfig {
        SamplingConfig {
            max_new_tokens: 3,
            decoding: Decoding::Sample(SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                top_k: Some(20),
                min_p: 0.05,
                repetition_penalty: 1.1,
            }),
            seed: 0,
            stop_ids: vec![2],
            first_stream: 0,
        }
    }

    fn output(ids: &[u64], reason: Value) -> Value {
        let lps: Vec<Value> = ids.iter().map(|i| json!([-0.5, i, null])).collect();
        json!({"output_ids": ids, "meta_info": {
            "finish_reason": reason, "output_token_logprobs": lps, "weight_version": "step-000001"}})
    }

    #[test]
    fn replies_are_checked_field_by_field() {
        let s = sampling();
        let e = Expect {
            url: "http://s0",
            n: 2,
            vocab_size: 10,
            sampling: &s,
            weight_version: Some("step-000001"),
        };
        let stop = json!({"type": "stop", "matched": 2});
        let length = json!({"type": "length", "length": 3});
        let good = json!([
            output(&[5, 2], stop.clone()),
            output(&[4, 4, 4], length.clone())
        ]);
        let g = parse_group(&good, &e).unwrap();
        assert_eq!(g[0].tokens, vec![5, 2]);
        assert_eq!(g[0].finish_reason, FinishReason::Stop);
        assert_eq!(
            (g[1].finish_reason, g[1].logprobs.len()),
            (FinishReason::Length, 3)
        );

        let err = |reply: Value| parse_group(&reply, &e).unwrap_err().to_string();
        let one = json!([output(&[5, 2], stop.clone())]);
        assert_eq!(err(one), "http://s0: (body): 1 outputs for n = 2");
        let big = json!([
            output(&[5, 12], stop.clone()),
            output(&[4, 2], stop.clone())
        ]);
        assert!(err(big).contains("[0].output_ids[1]: id 12 is outside the vocabulary of 10"));
        let short = json!([output(&[5, 2], stop.clone()), output(&[4], length.clone())]);
        assert!(err(short).contains("[1].meta_info.finish_reason: length, after 1 of 3"));
        let no_stop = json!([output(&[5, 4], stop.clone()), output(&[4, 2], stop.clone())]);
        assert!(err(no_stop).contains("[0].meta_info.finish_reason: stop, but the last token"));
        let mut stale = good.clone();
        stale[1]["meta_info"]["weight_version"] = json!("step-000000");
        assert!(err(stale).contains("[1].meta_info.weight_version: \"step-000000\""));
        let mut cut = good.clone();
        cut[0]["meta_info"]["output_token_logprobs"] = json!([[-0.5, 5, null]]);
        assert!(err(cut).contains("1 entries for 2 output ids"));
        assert!(err(json!("oops")).contains("neither a list nor an object"));
    }

    #[test]
    fn the_request_carries_the_run_sampling_settings() {
        let b = generate_body(&[1, 2, 3], 8, &sampling());
        assert_eq!(b["input_ids"], json!([1, 2, 3]));
        let p = &b["sampling_params"];
        assert_eq!((p["n"].clone(), p["top_k"].clone()), (json!(8), json!(20)));
        assert_eq!(p["stop_token_ids"], json!([2]));
        assert_eq!(
            (p["temperature"].as_f64(), p["top_p"].as_f64()),
            (Some(0.7), Some(0.9))
        );
        assert_eq!(p["min_p"].as_f64(), Some(0.05));
        assert_eq!(p["repetition_penalty"].as_f64(), Some(1.1f32 as f64));
        assert_eq!(b["return_logprob"], json!(true));
    }
}
