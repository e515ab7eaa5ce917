//! shoal-store: what shoal writes to disk.
//!
//! [`EventFileWriter`] stores filtered events in a Parquet file (schema in
//! `docs/output-format.md` and [`event_schema`]): one row per event, its hits as a nested
//! list column, so `pyarrow.parquet.read_table(...)` or pandas read it directly and ROOT
//! users can convert it with `uproot`/`awkward`. Rows are buffered and flushed as record
//! batches of [`EventFileWriter::BATCH_ROWS`] events.
//!
//! [`RawFileWriter`] stores raw fragments saved by the builders' burst savers (for an
//! alert) and late-data side streams: one row per fragment, indexed by alert, slice and
//! source, its payload byte for byte ([`raw_schema`]).

pub mod custody;

use std::fs::File;
use std::path::{Path, PathBuf};

use custody::{ChecksumWriter, FileSeal};
use std::sync::Arc;

use arrow_array::builder::{
    BinaryBuilder, BooleanBuilder, ListBuilder, StringBuilder, StructBuilder, TimestampNanosecondBuilder, UInt8Builder,
    UInt32Builder, UInt64Builder,
};
use arrow_array::{ArrayRef, RecordBatch, UInt64Array};
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef, TimeUnit};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use shoal_core::event::Event;

/// Errors while writing output files.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create {path}: {source}")]
    Create { path: PathBuf, source: std::io::Error },
    #[error("cannot write {path} to the disk: {source}")]
    Sync { path: PathBuf, source: std::io::Error },
    #[error("parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    #[error("arrow: {0}")]
    Arrow(#[from] arrow_schema::ArrowError),
}

fn hit_fields() -> Fields {
    Fields::from(vec![
        Field::new("source", DataType::UInt32, false),
        Field::new("channel", DataType::UInt8, false),
        Field::new("time_ns", DataType::UInt32, false),
        Field::new("amplitude", DataType::UInt8, false),
        Field::new("triggered", DataType::Boolean, false),
    ])
}

fn hit_list_item() -> Field {
    Field::new("item", DataType::Struct(hit_fields()), false)
}

/// The Parquet schema of an event file.
pub fn event_schema() -> SchemaRef {
    let ts = DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into()));
    Arc::new(Schema::new(vec![
        Field::new("run", DataType::UInt64, false),
        Field::new("slice", DataType::UInt64, false),
        Field::new("builder", DataType::UInt32, false),
        Field::new("event_id", DataType::UInt32, false),
        Field::new("trigger_mask", DataType::UInt32, false),
        Field::new("overlays", DataType::UInt32, false),
        Field::new("slice_start", ts.clone(), false),
        Field::new("time", ts, false),
        Field::new("n_hits", DataType::UInt32, false),
        Field::new("n_triggered", DataType::UInt32, false),
        Field::new("hits", DataType::List(Arc::new(hit_list_item())), false),
    ]))
}

/// Totals of a closed event file.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EventFileStats {
    pub path: PathBuf,
    pub events: u64,
    pub hits: u64,
    pub bytes: u64,
    /// The closed file's size and adler32, computed while it was written (none: totals
    /// over several files).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seal: Option<FileSeal>,
}

/// Writes events to a Parquet file. See the crate documentation.
pub struct EventFileWriter {
    path: PathBuf,
    run: u64,
    writer: ArrowWriter<ChecksumWriter<File>>,
    schema: SchemaRef,
    rows: Rows,
    stats: EventFileStats,
}

struct Rows {
    n: usize,
    run: UInt64Builder,
    slice: UInt64Builder,
    builder: UInt32Builder,
    event_id: UInt32Builder,
    trigger_mask: UInt32Builder,
    overlays: UInt32Builder,
    slice_start: TimestampNanosecondBuilder,
    time: TimestampNanosecondBuilder,
    n_hits: UInt32Builder,
    n_triggered: UInt32Builder,
    hits: ListBuilder<StructBuilder>,
}

impl Rows {
    fn new() -> Self {
        Self {
            n: 0,
            run: UInt64Builder::new(),
            slice: UInt64Builder::new(),
            builder: UInt32Builder::new(),
            event_id: UInt32Builder::new(),
            trigger_mask: UInt32Builder::new(),
            overlays: UInt32Builder::new(),
            slice_start: TimestampNanosecondBuilder::new().with_timezone("UTC"),
            time: TimestampNanosecondBuilder::new().with_timezone("UTC"),
            n_hits: UInt32Builder::new(),
            n_triggered: UInt32Builder::new(),
            hits: ListBuilder::new(StructBuilder::from_fields(hit_fields(), 0)).with_field(Arc::new(hit_list_item())),
        }
    }

    fn finish(&mut self, schema: &SchemaRef) -> Result<RecordBatch, StoreError> {
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.run.finish()),
            Arc::new(self.slice.finish()),
            Arc::new(self.builder.finish()),
            Arc::new(self.event_id.finish()),
            Arc::new(self.trigger_mask.finish()),
            Arc::new(self.overlays.finish()),
            Arc::new(self.slice_start.finish()),
            Arc::new(self.time.finish()),
            Arc::new(self.n_hits.finish()),
            Arc::new(self.n_triggered.finish()),
            Arc::new(self.hits.finish()),
        ];
        self.n = 0;
        Ok(RecordBatch::try_new(schema.clone(), columns)?)
    }
}

fn ts(ns: u64) -> i64 {
    i64::try_from(ns).unwrap_or(i64::MAX)
}

impl EventFileWriter {
    /// Rows per record batch (and at most per row group flush).
    pub const BATCH_ROWS: usize = 4096;

    pub fn create(path: impl AsRef<Path>, run: u64) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let file = File::create(&path).map_err(|source| StoreError::Create { path: path.clone(), source })?;
        let schema = event_schema();
        let props = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
        let writer = ArrowWriter::try_new(ChecksumWriter::new(file), schema.clone(), Some(props))?;
        Ok(Self {
            stats: EventFileStats { path: path.clone(), ..Default::default() },
            path,
            run,
            writer,
            schema,
            rows: Rows::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends the events of one slice.
    pub fn write_slice(
        &mut self,
        builder: u32,
        slice: u64,
        slice_start_ns: u64,
        events: &[Event],
    ) -> Result<(), StoreError> {
        for e in events {
            let r = &mut self.rows;
            r.run.append_value(self.run);
            r.slice.append_value(slice);
            r.builder.append_value(builder);
            r.event_id.append_value(e.id);
            r.trigger_mask.append_value(e.trigger_mask);
            r.overlays.append_value(e.overlays);
            r.slice_start.append_value(ts(slice_start_ns));
            r.time.append_value(ts(slice_start_ns + u64::from(e.first_time_ns().unwrap_or(0))));
            r.n_hits.append_value(e.hits.len() as u32);
            r.n_triggered.append_value(e.triggered_hits() as u32);
            let sb = r.hits.values();
            for h in &e.hits {
                sb.field_builder::<UInt32Builder>(0).expect("source").append_value(h.source);
                sb.field_builder::<UInt8Builder>(1).expect("channel").append_value(h.channel);
                sb.field_builder::<UInt32Builder>(2).expect("time_ns").append_value(h.time_ns);
                sb.field_builder::<UInt8Builder>(3).expect("amplitude").append_value(h.amplitude);
                sb.field_builder::<BooleanBuilder>(4).expect("triggered").append_value(h.triggered);
                sb.append(true);
            }
            r.hits.append(true);
            r.n += 1;
            self.stats.events += 1;
            self.stats.hits += e.hits.len() as u64;
            if r.n >= Self::BATCH_ROWS {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        if self.rows.n > 0 {
            let batch = self.rows.finish(&self.schema)?;
            self.writer.write(&batch)?;
        }
        Ok(())
    }

    /// Flushes and closes the file.
    pub fn close(mut self) -> Result<EventFileStats, StoreError> {
        self.flush()?;
        let seal = close_synced(self.writer, &self.path)?;
        self.stats.bytes = seal.bytes;
        self.stats.seal = Some(seal);
        Ok(self.stats)
    }
}

/// Writes a Parquet file's footer and syncs the file to the disk; its size and adler32.
fn close_synced(writer: ArrowWriter<ChecksumWriter<File>>, path: &Path) -> Result<FileSeal, StoreError> {
    let (file, seal) = writer.into_inner()?.into_parts();
    file.sync_all().map_err(|source| StoreError::Sync { path: path.to_path_buf(), source })?;
    Ok(seal)
}

/// The Parquet schema of a raw-data file.
pub fn raw_schema() -> SchemaRef {
    let ts = DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into()));
    Arc::new(Schema::new(vec![
        Field::new("run", DataType::UInt64, false),
        Field::new("builder", DataType::UInt32, false),
        // `alert` or `late`.
        Field::new("stream", DataType::Utf8, false),
        // The builder's alert number (0 for the late stream) and the alert's name.
        Field::new("alert", DataType::UInt32, false),
        Field::new("alert_name", DataType::Utf8, true),
        Field::new("slice", DataType::UInt64, false),
        Field::new("source", DataType::UInt32, false),
        Field::new("slice_start", ts, false),
        Field::new("hit_count", DataType::UInt32, false),
        Field::new("payload", DataType::Binary, false),
    ]))
}

/// Totals of a closed raw-data file.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RawFileStats {
    pub path: PathBuf,
    /// Fragments saved for alerts and from the late stream, and their payload bytes.
    pub alert_fragments: u64,
    pub late_fragments: u64,
    pub payload_bytes: u64,
    pub bytes: u64,
    /// The closed file's size and adler32, computed while it was written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seal: Option<FileSeal>,
}

/// One raw fragment to store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawRow<'a> {
    pub builder: u32,
    /// 0: the late stream (or a stored slice); otherwise the builder's alert number.
    pub alert: u32,
    /// A fragment of a processed slice stored whole (`builder.store_slices`): stream
    /// `slice` instead of `late`.
    pub whole_slice: bool,
    pub alert_name: Option<&'a str>,
    pub slice: u64,
    pub source: u32,
    pub slice_start_ns: u64,
    pub hit_count: u32,
    pub payload: &'a [u8],
}

/// Writes raw fragments to a Parquet file. See the crate documentation.
pub struct RawFileWriter {
    path: PathBuf,
    run: u64,
    writer: ArrowWriter<ChecksumWriter<File>>,
    schema: SchemaRef,
    n: usize,
    batch_bytes: usize,
    builder: UInt32Builder,
    stream: StringBuilder,
    alert: UInt32Builder,
    alert_name: StringBuilder,
    slice: UInt64Builder,
    source: UInt32Builder,
    slice_start: TimestampNanosecondBuilder,
    hit_count: UInt32Builder,
    payload: BinaryBuilder,
    stats: RawFileStats,
}

impl RawFileWriter {
    /// A record batch is written every this many payload bytes (bounds the writer's memory).
    pub const BATCH_BYTES: usize = 16 << 20;
    /// A row group is closed once its encoded columns reach this size.
    pub const ROW_GROUP_BYTES: usize = 64 << 20;

    pub fn create(path: impl AsRef<Path>, run: u64) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        let file = File::create(&path).map_err(|source| StoreError::Create { path: path.clone(), source })?;
        let schema = raw_schema();
        let props = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
        let writer = ArrowWriter::try_new(ChecksumWriter::new(file), schema.clone(), Some(props))?;
        Ok(Self {
            stats: RawFileStats { path: path.clone(), ..Default::default() },
            path,
            run,
            writer,
            schema,
            n: 0,
            batch_bytes: 0,
            builder: UInt32Builder::new(),
            stream: StringBuilder::new(),
            alert: UInt32Builder::new(),
            alert_name: StringBuilder::new(),
            slice: UInt64Builder::new(),
            source: UInt32Builder::new(),
            slice_start: TimestampNanosecondBuilder::new().with_timezone("UTC"),
            hit_count: UInt32Builder::new(),
            payload: BinaryBuilder::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write(&mut self, row: &RawRow<'_>) -> Result<(), StoreError> {
        self.builder.append_value(row.builder);
        self.stream.append_value(match (row.whole_slice, row.alert) {
            (true, _) => "slice",
            (false, 0) => "late",
            (false, _) => "alert",
        });
        self.alert.append_value(row.alert);
        self.alert_name.append_option(row.alert_name);
        self.slice.append_value(row.slice);
        self.source.append_value(row.source);
        self.slice_start.append_value(ts(row.slice_start_ns));
        self.hit_count.append_value(row.hit_count);
        self.payload.append_value(row.payload);
        self.n += 1;
        self.batch_bytes += row.payload.len();
        if row.alert == 0 {
            self.stats.late_fragments += 1;
        } else {
            self.stats.alert_fragments += 1;
        }
        self.stats.payload_bytes += row.payload.len() as u64;
        if self.batch_bytes >= Self::BATCH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        if self.n == 0 {
            return Ok(());
        }
        let run = UInt64Array::from(vec![self.run; self.n]);
        let columns: Vec<ArrayRef> = vec![
            Arc::new(run),
            Arc::new(self.builder.finish()),
            Arc::new(self.stream.finish()),
            Arc::new(self.alert.finish()),
            Arc::new(self.alert_name.finish()),
            Arc::new(self.slice.finish()),
            Arc::new(self.source.finish()),
            Arc::new(self.slice_start.finish()),
            Arc::new(self.hit_count.finish()),
            Arc::new(self.payload.finish()),
        ];
        self.n = 0;
        self.batch_bytes = 0;
        self.writer.write(&RecordBatch::try_new(self.schema.clone(), columns)?)?;
        // Row groups by size, not by row count (the default, a million rows, would hold a
        // whole alert's payloads in memory until the file closes).
        if self.writer.in_progress_size() >= Self::ROW_GROUP_BYTES {
            self.writer.flush()?;
        }
        Ok(())
    }

    /// Flushes and closes the file.
    pub fn close(mut self) -> Result<RawFileStats, StoreError> {
        self.flush()?;
        let seal = close_synced(self.writer, &self.path)?;
        self.stats.bytes = seal.bytes;
        self.stats.seal = Some(seal);
        Ok(self.stats)
    }
}

/// A raw-data row read back ([`read_raw`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredRawRow {
    pub builder: u32,
    /// `alert` or `late`.
    pub stream: String,
    pub alert: u32,
    pub alert_name: Option<String>,
    pub slice: u64,
    pub source: u32,
    pub slice_start_ns: u64,
    pub hit_count: u32,
    pub payload: Vec<u8>,
}

/// Reads a whole raw-data file (for checks and small analyses; pyarrow reads it too).
pub fn read_raw(path: impl AsRef<Path>) -> Result<Vec<StoredRawRow>, StoreError> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{TimestampNanosecondType, UInt32Type, UInt64Type};
    let path = path.as_ref();
    let file = File::open(path).map_err(|source| StoreError::Create { path: path.to_path_buf(), source })?;
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)?.build()?;
    let mut rows = Vec::new();
    for batch in reader {
        let b = batch?;
        let col = |name: &str| {
            b.column_by_name(name).ok_or_else(|| arrow_schema::ArrowError::SchemaError(format!("no column {name}")))
        };
        let (builder, stream, alert, name) = (
            col("builder")?.as_primitive::<UInt32Type>(),
            col("stream")?.as_string::<i32>(),
            col("alert")?.as_primitive::<UInt32Type>(),
            col("alert_name")?.as_string::<i32>(),
        );
        let (slice, source, start, hits, payload) = (
            col("slice")?.as_primitive::<UInt64Type>(),
            col("source")?.as_primitive::<UInt32Type>(),
            col("slice_start")?.as_primitive::<TimestampNanosecondType>(),
            col("hit_count")?.as_primitive::<UInt32Type>(),
            col("payload")?.as_binary::<i32>(),
        );
        for r in 0..b.num_rows() {
            rows.push(StoredRawRow {
                builder: builder.value(r),
                stream: stream.value(r).to_string(),
                alert: alert.value(r),
                alert_name: (!arrow_array::Array::is_null(name, r)).then(|| name.value(r).to_string()),
                slice: slice.value(r),
                source: source.value(r),
                slice_start_ns: start.value(r).max(0) as u64,
                hit_count: hits.value(r),
                payload: payload.value(r).to_vec(),
            });
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use shoal_core::event::EventHit;

    #[test]
    fn writes_readable_file() {
        let dir = std::env::temp_dir().join(format!("shoal-store-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("events.parquet");
        let mut w = EventFileWriter::create(&path, 7).unwrap();
        let hit = |t, trig| EventHit { source: 2, channel: 1, time_ns: t, amplitude: 30, triggered: trig };
        let events: Vec<Event> = (0..5000)
            .map(|i| Event { id: i, trigger_mask: 1, overlays: 0, hits: vec![hit(100 + i, true), hit(200 + i, false)] })
            .collect();
        w.write_slice(3, 42, 1_000_000_000, &events).unwrap();
        let stats = w.close().unwrap();
        assert_eq!((stats.events, stats.hits), (5000, 10_000));
        // The seal computed while writing is the file's as read back from the disk.
        assert_eq!(stats.seal, Some(custody::seal_of_file(&path).unwrap()));
        assert_eq!(stats.bytes, std::fs::metadata(&path).unwrap().len());
        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&path).unwrap()).unwrap().build().unwrap();
        let mut rows = 0;
        for batch in reader {
            let batch = batch.unwrap();
            assert_eq!(batch.schema(), event_schema());
            rows += batch.num_rows();
        }
        assert_eq!(rows, 5000);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn raw_rows_read_back_byte_for_byte() {
        use arrow_array::{Array, BinaryArray, StringArray};
        let dir = std::env::temp_dir().join(format!("shoal-store-raw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("raw.parquet");
        let mut w = RawFileWriter::create(&path, 7).unwrap();
        let payloads: Vec<Vec<u8>> = (0..300u32).map(|i| (0..i * 1000).map(|b| (b ^ i) as u8).collect()).collect();
        for (i, p) in payloads.iter().enumerate() {
            let alert = (i % 3) as u32;
            let name = (alert > 0).then_some("GRB");
            let row = RawRow {
                whole_slice: false,
                builder: 1,
                alert,
                alert_name: name,
                slice: i as u64,
                source: 4,
                slice_start_ns: 9,
                hit_count: 0,
                payload: p,
            };
            w.write(&row).unwrap();
        }
        let stats = w.close().unwrap();
        assert_eq!((stats.alert_fragments, stats.late_fragments), (200, 100));
        assert_eq!(stats.seal, Some(custody::seal_of_file(&path).unwrap()));
        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&path).unwrap()).unwrap().build().unwrap();
        let mut i = 0;
        for batch in reader {
            let batch = batch.unwrap();
            assert_eq!(batch.schema(), raw_schema());
            let payload = batch.column(9).as_any().downcast_ref::<BinaryArray>().unwrap();
            let stream = batch.column(2).as_any().downcast_ref::<StringArray>().unwrap();
            let name = batch.column(4).as_any().downcast_ref::<StringArray>().unwrap();
            for r in 0..batch.num_rows() {
                assert_eq!(payload.value(r), &payloads[i][..]);
                assert_eq!(stream.value(r), if i % 3 == 0 { "late" } else { "alert" });
                assert_eq!(name.is_null(r), i % 3 == 0);
                i += 1;
            }
        }
        assert_eq!(i, 300);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
