//! shoal-store: what shoal writes to disk.
//!
//! [`EventFileWriter`] stores filtered events in a Parquet file (schema in
//! `docs/output-format.md` and [`event_schema`]): one row per event, its hits as a nested
//! list column, so `pyarrow.parquet.read_table(...)` or pandas read it directly and ROOT
//! users can convert it with `uproot`/`awkward`. Rows are buffered and flushed as record
//! batches of [`EventFileWriter::BATCH_ROWS`] events.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{
    BooleanBuilder, ListBuilder, StructBuilder, TimestampNanosecondBuilder, UInt8Builder, UInt32Builder, UInt64Builder,
};
use arrow_array::{ArrayRef, RecordBatch};
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
}

/// Writes events to a Parquet file. See the crate documentation.
pub struct EventFileWriter {
    path: PathBuf,
    run: u64,
    writer: ArrowWriter<File>,
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
        let writer = ArrowWriter::try_new(file, schema.clone(), Some(props))?;
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
        self.writer.close()?;
        self.stats.bytes = std::fs::metadata(&self.path).map(|m| m.len()).unwrap_or(0);
        Ok(self.stats)
    }
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
}
