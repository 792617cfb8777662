//! Each column is stored with the encoding its definition names, compressed
//! with zstd, so the on-disk cost is what the format promises.

use std::fs::File;

use parquet::basic::{Compression, Encoding as ParquetEncoding};
use parquet::file::reader::{FileReader, SerializedFileReader};
use shadowtrace_schemas::{Encoding, Table};
use shadowtrace_tracer::WriterOptions;
use shadowtrace_tracer::writer::part_path;

use crate::support::small_spec;

#[test]
fn every_column_uses_its_defined_encoding_and_zstd() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("enc");
    small_spec("enc")
        .write(&dir, WriterOptions::default())
        .unwrap();
    for table in Table::ALL {
        let path = dir.join(part_path(table, 0));
        let reader = SerializedFileReader::new(File::open(&path).unwrap()).unwrap();
        let spec = table.spec();
        for rg in reader.metadata().row_groups() {
            for chunk in rg.columns() {
                let top = chunk.column_path().parts()[0].clone();
                let column = spec.column(&top).unwrap();
                let encodings: Vec<ParquetEncoding> = chunk.encodings().collect();
                let expected = match column.encoding {
                    Encoding::Dictionary => ParquetEncoding::RLE_DICTIONARY,
                    Encoding::Delta => ParquetEncoding::DELTA_BINARY_PACKED,
                    Encoding::ByteStreamSplit => ParquetEncoding::BYTE_STREAM_SPLIT,
                    Encoding::Plain => ParquetEncoding::PLAIN,
                };
                assert!(
                    encodings.contains(&expected),
                    "{table}.{top}: {encodings:?} lacks {expected:?}"
                );
                assert!(
                    matches!(chunk.compression(), Compression::ZSTD(_)),
                    "{table}.{top}: {:?}",
                    chunk.compression()
                );
            }
        }
    }
}
