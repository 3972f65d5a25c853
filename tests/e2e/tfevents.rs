//! A reader of TensorBoard event files written for the tests from the format's description
//! (TFRecord framing, TensorFlow's `Event` / `Summary` messages), sharing no code with
//! `conrub_trainer::tensorboard`: records are checked against their masked CRC-32C (computed bit
//! by bit here) and the messages decoded field by field.

use std::path::Path;

/// What one event holds that the tests look at.
#[derive(Debug, Default, Clone)]
pub struct Event {
    pub wall_time: f64,
    pub step: i64,
    pub file_version: Option<String>,
    /// `(tag, simple_value)` of each scalar value.
    pub scalars: Vec<(String, f32)>,
    /// `(tag, bucket counts)` of each histogram value.
    pub histograms: Vec<(String, Vec<f64>)>,
    /// `(tag, text)` of each string tensor value.
    pub texts: Vec<(String, String)>,
    /// The session log's status, when the event is one.
    pub session_status: Option<u64>,
}

fn crc32c_bitwise(data: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &byte in data {
        crc ^= byte as u32;
        for _ in 0..8 {
            let lsb = crc & 1;
            crc >>= 1;
            if lsb != 0 {
                crc ^= 0x82f6_3b78;
            }
        }
    }
    crc ^ 0xffff_ffff
}

fn masked(data: &[u8]) -> u32 {
    let c = crc32c_bitwise(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One field of a message: number and value.
enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

fn varint(buf: &[u8], at: &mut usize) -> u64 {
    let mut v = 0u64;
    let mut shift = 0;
    loop {
        let b = buf[*at];
        *at += 1;
        v |= ((b & 0x7f) as u64) << shift;
        if b < 0x80 {
            return v;
        }
        shift += 7;
    }
}

fn fields(buf: &[u8]) -> Vec<(u64, Field<'_>)> {
    let mut at = 0;
    let mut out = Vec::new();
    while at < buf.len() {
        let key = varint(buf, &mut at);
        let field = match key & 7 {
            0 => Field::Varint(varint(buf, &mut at)),
            1 => {
                at += 8;
                Field::Fixed64(buf[at - 8..at].try_into().unwrap())
            }
            2 => {
                let len = varint(buf, &mut at) as usize;
                at += len;
                Field::Bytes(&buf[at - len..at])
            }
            5 => {
                at += 4;
                Field::Fixed32(buf[at - 4..at].try_into().unwrap())
            }
            w => panic!("wire type {w} in an event"),
        };
        out.push((key >> 3, field));
    }
    out
}

fn summary_value(buf: &[u8], event: &mut Event) {
    let mut tag = String::new();
    let (mut simple, mut histo, mut text) = (None, None, None);
    for (n, f) in fields(buf) {
        match (n, f) {
            (1, Field::Bytes(b)) => tag = String::from_utf8(b.to_vec()).unwrap(),
            (2, Field::Fixed32(b)) => simple = Some(f32::from_le_bytes(b)),
            (5, Field::Bytes(b)) => {
                let mut counts = Vec::new();
                for (n, f) in fields(b) {
                    if let (7, Field::Bytes(packed)) = (n, f) {
                        counts = packed
                            .chunks(8)
                            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                            .collect();
                    }
                }
                histo = Some(counts);
            }
            (8, Field::Bytes(b)) => {
                for (n, f) in fields(b) {
                    if let (8, Field::Bytes(s)) = (n, f) {
                        text = Some(String::from_utf8(s.to_vec()).unwrap());
                    }
                }
            }
            _ => {}
        }
    }
    if let Some(v) = simple {
        event.scalars.push((tag.clone(), v));
    }
    if let Some(h) = histo {
        event.histograms.push((tag.clone(), h));
    }
    if let Some(t) = text {
        event.texts.push((tag, t));
    }
}

fn event(buf: &[u8]) -> Event {
    let mut e = Event::default();
    for (n, f) in fields(buf) {
        match (n, f) {
            (1, Field::Fixed64(b)) => e.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => e.step = v as i64,
            (3, Field::Bytes(b)) => e.file_version = Some(String::from_utf8(b.to_vec()).unwrap()),
            (5, Field::Bytes(b)) => {
                for (n, f) in fields(b) {
                    if let (1, Field::Bytes(v)) = (n, f) {
                        summary_value(v, &mut e);
                    }
                }
            }
            // `session_log` is field 7 of event.proto (6 is the deprecated `log_message`).
            (7, Field::Bytes(b)) => {
                for (n, f) in fields(b) {
                    if let (1, Field::Varint(s)) = (n, f) {
                        e.session_status = Some(s);
                    }
                }
            }
            _ => {}
        }
    }
    e
}

/// Every event of the file at `path`, every record's checksums checked.
pub fn read(path: &Path) -> Vec<Event> {
    let data = std::fs::read(path).unwrap();
    let mut at = 0;
    let mut out = Vec::new();
    while at < data.len() {
        let len_bytes = &data[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(data[at + 8..at + 12].try_into().unwrap());
        assert_eq!(len_crc, masked(len_bytes), "length checksum at byte {at}");
        let payload = &data[at + 12..at + 12 + len];
        let crc = u32::from_le_bytes(data[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(crc, masked(payload), "payload checksum at byte {at}");
        out.push(event(payload));
        at += 16 + len;
    }
    out
}

/// The event files of a run's `tensorboard/` folder, oldest first.
pub fn files(output_dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(output_dir.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .collect();
    files.sort();
    files
}
